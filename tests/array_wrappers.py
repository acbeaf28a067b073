"""Arrays known by one protocol only, as other libraries' arrays are seen by linkwise."""


class DlpackOnly:
    """An array known only by DLPack (JAX's, or a thin wrapper), on the host or a GPU."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()
