"""Print the pip requirements that keep the installed torch and pick extras that work with it.

Used by the Makefile on the same pip command that installs probe's extras:

    pip install -e '.[test,examples,models]' $(python scripts/torch_pins.py)

* ``torch==<installed version>``: without it, an extra that depends on torch (transformers,
  or timm, which once replaced torch 2.13 with a 2.15 CUDA build) may upgrade it;
* ``transformers<5`` on torch < 2.6: transformers 5 disables its torch backend below 2.6
  (``Disabling PyTorch because PyTorch >= 2.6 is required``); 4.57.6 works on 2.4.1.
"""

from importlib.metadata import PackageNotFoundError, version


def pins() -> list[str]:
    try:
        torch = version("torch")
    except PackageNotFoundError:
        return []  # nothing to hold: pip resolves torch itself
    requirements = [f"torch=={torch}"]
    major, minor = (int(part) for part in torch.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 6):
        requirements.append("transformers<5")
    return requirements


if __name__ == "__main__":
    print(" ".join(pins()))
