"""The run log: the HDF5 file, its schema declared once, and what the printing rank shows."""
