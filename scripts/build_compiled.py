"""Build the optional compiled simulator and scheduler (``make compiled``; ``dualpath/compiled.py``).

    python scripts/build_compiled.py            # needs mypy (the `compiled` extra) and gcc

mypyc compiles ``dualpath.compiled.COMPILED_MODULES`` into C extensions, one module per C file
(compiled in parallel), in a staging directory; the manifest of the sources' digests, taken
before compiling, is written last, and the staging directory then replaces the old build. A
failed build leaves no manifest, so nothing half-built is ever loaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

# Only the compiled modules must type-check: the modules they import are read for their types
# without being checked, and the heavy third-party packages some of those import are not read
# at all (analysing torch alone takes minutes).
_MYPY_CONFIG = """\
[mypy]
follow_imports = silent
ignore_missing_imports = True
cache_dir = {cache_dir}

[mypy-torch.*,numpy.*,scipy.*,matplotlib.*,transformers.*]
follow_imports = skip
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--opt-level", default="3", choices=["0", "1", "2", "3"], help="C optimisation level"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="C files compiled at once"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even when the build is fresh already"
    )
    args = parser.parse_args()
    from dualpath import compiled

    if not args.force and compiled.unusable_reason(compiled.build_dir()) is None:
        print(f"the compiled build in {compiled.build_dir()} is fresh (--force rebuilds it)")
        return 0
    try:
        import mypy.version
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as error:
        print(
            f"error: {error.name} is missing: `make compiled` installs it "
            "(pip install -e '.[compiled]')",
            file=sys.stderr,
        )
        return 2

    directory = compiled.build_dir()
    staging = directory.with_name(directory.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    digests = compiled.source_digests()
    sources = [str(compiled.source_path(module)) for module in compiled.COMPILED_MODULES]
    start_s = time.monotonic()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="dualpath-mypyc-") as temp:
        config = os.path.join(temp, "mypy.ini")
        with open(config, "w") as file:
            file.write(_MYPY_CONFIG.format(cache_dir=os.path.join(temp, "mypy_cache")))
        extensions = mypycify(
            ["--config-file", config, *sources],
            opt_level=args.opt_level,
            multi_file=True,
            group_name=compiled.GROUP_NAME,
            target_dir=os.path.join(temp, "c"),
        )
        os.chdir(temp)  # (setuptools would read the project's pyproject.toml in the cwd)
        try:
            setup(
                name="dualpath-compiled",
                ext_modules=extensions,
                script_args=[
                    "--quiet",
                    "build_ext",
                    f"--build-lib={staging}",
                    f"--build-temp={os.path.join(temp, 'o')}",
                    f"--parallel={args.jobs}",
                ],
            )
        finally:
            os.chdir(cwd)
    compiled.write_manifest(staging, digests, mypy.version.__version__)
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    print(f"compiled {len(sources)} modules in {time.monotonic() - start_s:.0f} s into {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
