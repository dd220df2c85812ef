"""Maps the repository's top-level folders into the single `k3serve` import namespace.

The repo keeps `kernels/`, `model/`, `engine/`, ... at the top level (see docs/STRUCTURE.md);
installed they become `k3serve.kernels`, `k3serve.model`, ... and never top-level packages.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("cluster", "prefill", "decode", "transfer", "kernels", "model", "engine")

packages = ["k3serve"]
package_dir = {"k3serve": "k3serve"}
for top in SUBPACKAGES:
    packages.append(f"k3serve.{top}")
    package_dir[f"k3serve.{top}"] = top
    packages += [f"k3serve.{top}.{sub}" for sub in find_packages(top)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"k3serve.model": ["assets/*", "assets/**/*"], "k3serve.transfer": ["proto/*.proto", "proto/*.pyi"]},
    include_package_data=True,
)
