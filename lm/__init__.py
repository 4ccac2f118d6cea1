"""lm: see ../shared/design.md."""
