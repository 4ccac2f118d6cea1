"""preprocess: see ../shared/design.md."""
