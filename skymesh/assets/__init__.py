"""Files that ship inside the package, and the ``pkg:`` form a config names them by.

``pkg:<package>/<path>`` is the file ``<path>`` inside the installed Python package
``<package>`` (``pkg:skymesh/assets/tokenizer/tokenizer.json``): it resolves the same
whatever the working directory, in a clone or an installed wheel. Any other path is used
as written (relative to the working directory of the process that reads it).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PACKAGE_PREFIX = "pkg:"
# the default mesh's tokenizer (a HF tokenizer folder: tokenizer.json,
# tokenizer_config.json, special_tokens_map.json), built by
# ``python -m skymesh.assets.build_tokenizer``
SIM_TOKENIZER_DIR = Path(__file__).with_name("tokenizer")
SIM_TOKENIZER = SIM_TOKENIZER_DIR / "tokenizer.json"
SIM_TOKENIZER_REF = "pkg:skymesh/assets/tokenizer/tokenizer.json"


def resolve_file_ref(ref: str) -> str:
    """The filesystem path of ``ref``: a ``pkg:`` reference resolved inside its package
    (ValueError when the package does not exist or the reference names none); any other
    string unchanged. Whether the file exists is for the reader to say."""
    if not ref.startswith(PACKAGE_PREFIX):
        return ref
    package, _, inner = ref[len(PACKAGE_PREFIX):].partition("/")
    if not package or not inner:
        raise ValueError(f"expected pkg:<package>/<path inside it>, got {ref!r}")
    try:
        root = resources.files(package)
    except (ModuleNotFoundError, TypeError):
        raise ValueError(f"{ref!r}: no Python package named {package!r}") from None
    return str(Path(str(root)) / inner)
