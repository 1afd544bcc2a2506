"""pmsnap errors raised from Python with the shape the C++ ones have.

The _pmsnap extension turns every failed C++ Status into an instance of a
pmsnap.Error subclass with `.code` set to the status code's name ("NotFound",
"ModelMismatch", ...). The pure-Python package raises the same classes for
what it checks itself, built by make_error so that `.code` is set alike.

Thread-safety: none needed (no shared state).
"""


def make_error(cls, message):
    """An instance of pmsnap error class `cls` with .code set like the C++ ones."""
    e = cls(message)
    e.code = cls.__name__[:-len("Error")] if cls.__name__.endswith("Error") else cls.__name__
    return e
