"""Run slime's async trainer with the adapter's flags registered.

    python -m slime_adapter.launch <train_async.py arguments...> \\
        --rollout-function-path slime_adapter.generate_rollout --agent-rollout-buffer-url http://HOST:8889

slime's `parse_args(add_custom_arguments)` calls a custom hook *before* it adds its own flags, so handing
it `add_arguments` would make slime's later `--loss-mask-type` or `--rollout-buffer-url` clash. The
launcher instead wraps slime's `get_slime_extra_args_provider` so the adapter's flags are added *after*
slime's, skipping the ones slime already defines, and then runs `train_async.py` as `__main__`.

`train_async.py` is looked up next to the installed `slime` package (a source checkout, as slime is
installed); set `SLIME_TRAIN_SCRIPT` to use another script (e.g. `train.py`). Needs slime installed.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slime_adapter.flags import add_arguments

TRAIN_SCRIPT_ENV = "SLIME_TRAIN_SCRIPT"
ProviderFactory = Callable[..., Callable[[argparse.ArgumentParser], argparse.ArgumentParser]]


def with_adapter_flags(provider_factory: ProviderFactory) -> ProviderFactory:
    """Wrap slime's `get_slime_extra_args_provider` so the adapter's flags follow slime's own."""
    if getattr(provider_factory, "_adds_adapter_flags", False):
        return provider_factory

    def factory(*args: Any, **kwargs: Any) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
        add_slime_arguments = provider_factory(*args, **kwargs)

        def add_all(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            return add_arguments(add_slime_arguments(parser) or parser)

        return add_all

    factory._adds_adapter_flags = True  # type: ignore[attr-defined]
    return factory


def install() -> None:
    """Patch slime's argument module so every `parse_args()` also registers the adapter's flags."""
    try:
        from slime.utils import arguments
    except ImportError as e:
        raise SystemExit(f"slime_adapter.launch needs slime installed ({e})") from None
    if not hasattr(arguments, "get_slime_extra_args_provider"):
        raise SystemExit("this slime has no get_slime_extra_args_provider; add the flags with add_arguments")
    arguments.get_slime_extra_args_provider = with_adapter_flags(arguments.get_slime_extra_args_provider)


def train_script() -> Path:
    """The trainer entry script: `$SLIME_TRAIN_SCRIPT`, else `train_async.py` of the slime checkout."""
    if os.environ.get(TRAIN_SCRIPT_ENV):
        path = Path(os.environ[TRAIN_SCRIPT_ENV])
    else:
        import slime

        path = Path(slime.__file__).resolve().parent.parent / "train_async.py"
    if not path.is_file():
        raise SystemExit(f"slime's trainer script {path} does not exist; set {TRAIN_SCRIPT_ENV}")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """Install the flags and run the trainer script with `argv` as its command line."""
    install()
    script = train_script()
    sys.argv = [str(script), *(sys.argv[1:] if argv is None else argv)]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
