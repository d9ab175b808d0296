"""Packaging for compressive_tutorial; every setting is read from settings.ini (nbdev 2)."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

ini = Path(__file__).resolve().parent / "settings.ini"   # beside this file, wherever pip runs it from
if not ini.is_file():
    raise SystemExit(f"{ini} is missing: the package's settings live there (an sdist must include it: see MANIFEST.in)")
config = ConfigParser(delimiters=["="])
config.read(ini, encoding="utf-8")
cfg = config["DEFAULT"]

licenses = {
    "apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License"),
    "mit": ("MIT License", "OSI Approved :: MIT License"),
}
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable",
            "6 - Mature", "7 - Inactive"]
py_versions = "3.10 3.11 3.12 3.13".split()


def reqs(key):
    "The space-separated requirement list `key` of settings.ini."
    return cfg.get(key, "").split()


lic = licenses.get(cfg["license"].lower(), (cfg["license"], None))
min_python = cfg["min_python"]
extras = {"dev": reqs("dev_requirements"), "docs": reqs("docs_requirements"),
          "experiments": reqs("experiments_requirements"), "bench": reqs("bench_requirements")}
extras["all"] = sorted({r for v in extras.values() for r in v})

setuptools.setup(
    name=cfg["repo"],
    license=lic[0],
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"])],
        "Intended Audience :: " + cfg["audience"].title(),
        "Natural Language :: " + cfg["language"].title(),
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ]
    + ["Programming Language :: Python :: " + v for v in py_versions[py_versions.index(min_python):]]
    + (["License :: " + lic[1]] if lic[1] else []),
    url=cfg["git_url"],
    packages=setuptools.find_packages(include=[cfg["lib_name"], cfg["lib_name"] + ".*"]),
    include_package_data=True,
    install_requires=reqs("requirements"),
    extras_require=extras,
    python_requires=">=" + min_python,
    long_description=(ini.parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    zip_safe=False,
    entry_points={
        "console_scripts": reqs("console_scripts"),
        "nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    version=cfg["version"],
    author=cfg["author"],
    author_email=cfg["author_email"],
    description=cfg["description"],
    keywords=cfg["keywords"],
)
