"""One module per area; each exposes click commands that call the library and map its errors."""
