"""The one exception users see: a clear sentence, never a traceback."""


class TracekitError(Exception):
    """An error whose message is meant for the user as it is."""


class LoadError(TracekitError):
    """A file could not be opened as a memory trace."""

    def __init__(self, path, what):
        self.path = str(path)
        self.what = what
        super().__init__(f"cannot open {self.path}: {what}")


class Cancelled(TracekitError):
    """Loading was cancelled by the user (raised from a progress callback)."""

    def __init__(self):
        super().__init__("cancelled")
