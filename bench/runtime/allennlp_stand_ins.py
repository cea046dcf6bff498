"""Stand-ins for the packages AllenNLP 2.10.1's ``__init__`` files import but its ELMo forward pass never calls.

Run with the AllenNLP venv's Python (scripts/allennlp-venv.sh does): it writes ``elmo_bench_stand_ins.py`` and a
``.pth`` file that loads it into that venv's site-packages. From then on an import of one of STAND_INS (or of a
submodule) that is not installed for real gives an empty module whose every attribute is a stand-in class;
calling a stand-in (which only module-level set-up code does on this path) gives another, and used as a decorator
it hands back what it decorates; ``cached_path.cached_path`` hands back the local path it is given. Nothing of the
ELMo forward pass goes through them: its arithmetic is torch's.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

# What allennlp/__init__.py and the __init__ files on the way to allennlp.modules.elmo import at load time.
STAND_INS = (
    "transformers",
    "spacy",
    "tqdm",
    "cached_path",
    "huggingface_hub",
    "more_itertools",
    "base58",
    "dill",
    "lmdb",
    "fairscale",
    "torchvision",
    "_jsonnet",
)

MODULE = '''"""Stand-in modules for AllenNLP's unused imports (written by bench/runtime/allennlp_stand_ins.py)."""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

NAMES = {names!r}


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return stand_in(cls.__qualname__ + "." + name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return stand_in(cls.__qualname__ + "()")

    def __iter__(cls):
        return iter(())

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def stand_in(name):
    return _Meta(name.rsplit(".", 1)[-1], (), {{"__qualname__": name, "__module__": "elmo_bench_stand_ins"}})


def local_path(url_or_filename, *args, **kwargs):
    """cached_path.cached_path for a local file (the bench's weights are local): the path itself."""
    return str(url_or_filename)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if (self.__name__, name) == ("cached_path", "cached_path"):
            return local_path
        return stand_in(self.__name__ + "." + name)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0"
        return module

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec  # installed for real: use it
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


sys.meta_path.append(_Finder())
'''


def install(site_packages: Path) -> Path:
    """Writes the stand-in module and the .pth line that loads it at start-up; returns the module's path."""
    module = site_packages / "elmo_bench_stand_ins.py"
    module.write_text(MODULE.format(names=set(STAND_INS)))
    (site_packages / "elmo_bench_stand_ins.pth").write_text("import elmo_bench_stand_ins\n")
    return module


if __name__ == "__main__":
    if sys.prefix == sys.base_prefix:
        sys.exit("run this with the AllenNLP venv's Python (scripts/allennlp-venv.sh), not a system Python")
    print(f"wrote {install(Path(site.getsitepackages()[0]))}")
