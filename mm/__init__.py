"""mm: see ../shared/design.md."""
