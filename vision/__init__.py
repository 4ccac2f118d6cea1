"""vision: see ../shared/design.md."""
