"""What a run is made of and how it starts: configuration, recipe, models, data, command line, Python API."""
