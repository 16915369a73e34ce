"""Packages for setuptools: every proxies* package, plus configs/ (sweep and machine files,
kept at the top of the checkout where the README and sweeps name them) installed as
proxies/configs/ so a wheel carries them (proxies/core/configs.py finds either)."""

from setuptools import find_packages, setup

CONFIGS = {"proxies.configs": "configs", "proxies.configs.machines": "configs/machines"}

setup(
    packages=[*find_packages(include=["proxies*"]), *CONFIGS],
    package_dir=CONFIGS,
    package_data={**{name: ["*.yaml"] for name in CONFIGS}, "proxies.schema": ["*.json"]},
)
