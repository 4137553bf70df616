"""Builds the native extension apex.native from native/ and lists the packages (everything
else is in pyproject.toml)."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_packages, setup

native = Pybind11Extension(
    "apex.native",
    sources=["native/bindings.cpp"],
    include_dirs=["native"],
    depends=["native/sum_tree.hpp"],
    cxx_std=17,
    # -O3 always: pip's default flags come from the Python build and may lack it. No
    # -march=native: an image built on one host must run on another.
    extra_compile_args=["-O3"],
)

setup(
    ext_modules=[native],
    # Every subpackage of apex, found rather than listed (a listed one was once missed), and
    # the presets in configs/ shipped as apex.configs, so `--config NAME` works where apex is
    # installed.
    packages=[*find_packages(include=["apex", "apex.*"]), "apex.configs"],
    package_dir={"apex.configs": "configs"},
)
