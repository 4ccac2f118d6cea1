"""app: see ../shared/design.md."""
