"""The survey's configuration: the config file's schema, the built-in presets, the grid's cells."""
