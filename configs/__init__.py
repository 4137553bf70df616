"""The shipped presets: `apex config list`, and `--config NAME` for NAME.yaml here."""
