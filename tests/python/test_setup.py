"""scripts/setup.sh installs every tool the build, the packaging and the tests call: each tool's
Debian package is one setup.sh names, something those depend on, or part of a minimal Debian 12
root (priority required). A tool the scripts need that only a developer's machine happened to
have (`file`, which CPack's .deb generator calls) fails here instead of on a fresh machine."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import SOURCE_DIR

# Every command scripts/build.sh, package.sh, test.sh, fuzz.sh, netns-link.sh and the tests run.
TOOLS = ["cmake", "ninja", "file", "dpkg-shlibdeps", "dpkg-deb", "redis-server", "redis-cli", "ip", "tc", "curl",
         "gnuplot", "clang++", "qemu-x86_64", "debootstrap", "g++", "pkg-config", "git", "chroot", "timeout",
         "/usr/bin/python3"]


def setup_packages():
    text = open(os.path.join(SOURCE_DIR, "scripts", "setup.sh")).read()
    body = re.search(r"packages=\((.*?)\)", text, re.S).group(1)
    return set(body.split())


def installed():
    """Package -> (priority, [dependency names, alternatives included]); virtual -> providers."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Priority}\t${Depends}, ${Pre-Depends}\t${Provides}\n"],
                         capture_output=True, text=True, check=True).stdout
    pkgs, provides = {}, {}
    for line in out.splitlines():
        name, prio, deps, prov = (line.split("\t") + ["", "", ""])[:4]
        names = [re.split(r"[ :(]", d.strip())[0] for d in re.split(r"[,|]", deps) if d.strip()]
        pkgs[name] = (prio, names)
        for p in prov.split(","):
            if p.strip():
                provides.setdefault(re.split(r"[ (]", p.strip())[0], []).append(name)
    return pkgs, provides


def owner(tool):
    path = tool if tool.startswith("/") else shutil.which(tool)
    if path is None:
        return None
    real = os.path.realpath(path)
    candidates = []
    for p in (path, real):
        candidates += [p, p.replace("/usr/", "/", 1) if p.startswith("/usr/") else "/usr" + p]
    for c in candidates:
        r = subprocess.run(["dpkg", "-S", c], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.split(":")[0].split(",")[0].strip()
    return None


def test_setup_installs_every_tool_the_scripts_and_tests_call():
    if shutil.which("dpkg-query") is None:
        pytest.skip("not a Debian machine")
    pkgs, provides = installed()
    roots = setup_packages() | {p for p, (prio, _) in pkgs.items() if prio == "required"} | {"apt"}
    reach, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p in reach:
            continue
        reach.add(p)
        todo += pkgs.get(p, ("", []))[1] + provides.get(p, [])
    missing = []
    for tool in TOOLS:
        pkg = owner(tool)
        assert pkg is not None, f"{tool} is not installed: scripts/setup.sh must install the package that has it"
        if pkg not in reach:
            missing.append(f"{tool} (package {pkg})")
    assert not missing, "scripts/setup.sh does not install: " + ", ".join(missing)
