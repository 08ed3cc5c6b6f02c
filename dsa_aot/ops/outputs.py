"""Op results: a dict that also unpacks and indexes like a tuple (as cudnn's TupleDict does)."""

__all__ = ["Outputs"]


class Outputs(dict):
    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, k):
        if isinstance(k, int):
            return list(self.values())[k]
        return super().__getitem__(k)
