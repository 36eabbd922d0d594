"""Pure functions over a Trace. They return plain data; CLI and GUI only display it."""
