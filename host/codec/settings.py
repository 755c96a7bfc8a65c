"""The choices a run makes about where its work runs and where its data lies, in one object
built once from command-line flags and the environment and passed down; commands print it
(:meth:`Settings.describe`). docs/settings.md tables the environment variables.

It lives in the bottom layer because every layer reads some of it: the codec its CPU
backend, the client its datapath and GSO, the aggregator command its datapath, training its
data. The codec and the client, built without one, take :func:`current`: the one a command
installed with :func:`use`, else one built from the environment on first use."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from typing import Mapping

DATAPATHS = ("auto", "compiled", "python")
CODEC_CPU = ("compiled", "reference")
FASHION_DEFAULT = "/usr/share/datasets/fashion-mnist"

ENV = {
    "client_datapath": "THC_CLIENT_DATAPATH",
    "client_gso": "THC_CLIENT_GSO",
    "aggregator_datapath": "THC_AGGREGATOR_DATAPATH",
    "codec_cpu": "THC_CODEC_CPU",
    "fashion_mnist": "THC_FASHION_MNIST",
}
"""The environment variable of each setting."""


@dataclass(frozen=True)
class Settings:
    client_datapath: str = "auto"
    """The client's window: ``compiled`` (C), ``python``, or ``auto`` (compiled where built)."""
    client_gso: bool | None = None
    """Compiled client rounds batch datagrams by UDP GSO/GRO; None: on for sharded jobs."""
    aggregator_datapath: str = "auto"
    """``thc aggregator``'s datapath: ``compiled``, ``python`` or ``auto``."""
    codec_cpu: str = "compiled"
    """What the codec's ``auto`` backend runs on the CPU: ``compiled`` or ``reference``."""
    fashion_mnist: str = FASHION_DEFAULT
    """The folder of Fashion-MNIST's gzipped IDX files."""

    def __post_init__(self):
        for name, allowed in (("client_datapath", DATAPATHS),
                              ("aggregator_datapath", DATAPATHS), ("codec_cpu", CODEC_CPU)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name.replace('_', ' ')} {value!r} is not one of "
                                 f"{', '.join(allowed)} (flag or {ENV[name]})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **flags) -> "Settings":
        """The environment's settings, overridden by the flags given (None: not given)."""
        env = os.environ if environ is None else environ
        values = {}
        for name in ("client_datapath", "aggregator_datapath", "codec_cpu"):
            text = env.get(ENV[name])
            if text:
                values[name] = text.lower()
        gso = (env.get(ENV["client_gso"]) or "").lower()
        if gso and gso != "auto":   # auto: as unset, the value describe() prints for it
            if gso not in ("0", "1"):
                raise ValueError(f"{ENV['client_gso']}={gso!r}: use auto, 0 or 1")
            values["client_gso"] = gso == "1"
        if env.get(ENV["fashion_mnist"]):
            values["fashion_mnist"] = env[ENV["fashion_mnist"]]
        for name, value in flags.items():
            if value is not None:
                values[name] = value.lower() if name in ("client_datapath",
                                                         "aggregator_datapath",
                                                         "codec_cpu") else value
        return cls(**values)

    def with_flags(self, **flags) -> "Settings":
        """These settings with the flags given (None: not given) in place."""
        return replace(self, **{k: v for k, v in flags.items() if v is not None})

    def describe(self) -> str:
        """One line for a command's output."""
        gso = "auto" if self.client_gso is None else ("on" if self.client_gso else "off")
        parts = [f"client datapath {self.client_datapath}", f"client GSO {gso}",
                 f"aggregator datapath {self.aggregator_datapath}",
                 f"codec CPU {self.codec_cpu}", f"Fashion-MNIST {self.fashion_mnist}"
                 + ("" if os.path.isdir(self.fashion_mnist) else " (absent)")]
        return "settings: " + ", ".join(parts)


FLAGS = {
    "client_datapath": ("--client-datapath", DATAPATHS,
                        "the aggregation client's window: auto is compiled where built"),
    "codec_cpu": ("--codec-cpu", CODEC_CPU, "what the codec runs on the CPU"),
    "aggregator_datapath": ("--datapath", DATAPATHS,
                            "the aggregator's datapath: auto is compiled where built; the "
                            "first line printed says which runs"),
}
"""The command-line flag of each setting that has one: (flag, choices, what it chooses)."""


def add_arguments(parser: argparse.ArgumentParser, *names: str) -> None:
    """The flags of the settings ``names``, each winning over its environment variable."""
    group = parser.add_argument_group("settings", "a flag wins over its environment variable "
                                                  "(docs/settings.md)")
    for name in names:
        flag, choices, what = FLAGS[name]
        group.add_argument(flag, dest=name, choices=choices, default=None, type=str.lower,
                           help=f"{what} (default: {ENV[name]}, else "
                                f"{getattr(Settings, name)})")


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """The environment's settings with the flags of :func:`add_arguments` in place."""
    return Settings.from_env(environ, **{name: getattr(args, name, None) for name in FLAGS})


_CURRENT: list[Settings] = []


def current() -> Settings:
    """The process's settings: those installed by :func:`use`, else the environment's (read
    once, on first use)."""
    if not _CURRENT:
        _CURRENT.append(Settings.from_env())
    return _CURRENT[0]


def use(settings: Settings) -> Settings:
    """Install ``settings`` as the process's (a command does, once it has read its flags)."""
    _CURRENT[:] = [settings]
    return settings


def reset() -> None:
    """Forget the installed settings: the next :func:`current` reads the environment again."""
    _CURRENT.clear()


__all__ = ["Settings", "current", "use", "reset", "add_arguments", "from_args", "ENV", "FLAGS",
           "DATAPATHS", "CODEC_CPU", "FASHION_DEFAULT"]
