"""Install and packages: a consumer project builds against `cmake --install` output (CMake
config and pkg-config), the portable build (scripts/package.sh) passes its kernel suites at every
tier and runs on a baseline x86-64 CPU (qemu), and its .deb packages install and run in a clean
Debian 12 root. Each part skips, saying why, where this machine cannot run it."""

import glob
import os
import shutil
import subprocess
import tarfile
import tempfile

import pytest

from conftest import CLI, SOURCE_DIR

BUILD_DIR = os.environ.get("KVSERVE_BUILD_DIR", os.path.join(SOURCE_DIR, "build"))
PKG_DIR = os.environ.get("KVSERVE_PKG_DIR", os.path.join(SOURCE_DIR, "build-pkg"))
CONSUMER = os.path.join(SOURCE_DIR, "tests", "install", "consumer")
KERNEL_SUITES = "CpuTier.*:Tiers/*:QuantStage.*:RansStage.*:Pipeline.*:Frame.*"


def sh(cmd, timeout=600, env=None, check=True, **kw):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def prefix():
    """This build installed into a temporary prefix, as `cmake --install` leaves it."""
    folder = tempfile.mkdtemp(prefix="kvserve-install-")
    sh(["cmake", "--install", BUILD_DIR, "--prefix", folder])
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_consumer_project_finds_the_installed_package(prefix, tmp_path):
    assert os.path.exists(os.path.join(prefix, "include", "kvserve", "codec.h"))
    cfg = glob.glob(os.path.join(prefix, "lib*", "**", "kvserveConfig.cmake"), recursive=True)
    assert cfg, "kvserveConfig.cmake not installed"
    build = tmp_path / "consumer"
    sh(["cmake", "-S", CONSUMER, "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}"])
    sh(["cmake", "--build", str(build)])
    out = sh([str(build / "consumer")]).stdout
    assert out.startswith("consumer ok: ratio "), out


def test_pkg_config_file_compiles_and_links(prefix, tmp_path):
    pcs = glob.glob(os.path.join(prefix, "lib*", "**", "kvserve.pc"), recursive=True)
    assert pcs, "kvserve.pc not installed"
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.dirname(pcs[0]))
    flags = sh(["pkg-config", "--cflags", "--libs", "kvserve"], env=env).stdout.split()
    libdir = next(f[2:] for f in flags if f.startswith("-L"))
    assert os.path.realpath(libdir).startswith(os.path.realpath(prefix)), flags
    exe = tmp_path / "consumer_pc"
    sh(["g++", os.path.join(CONSUMER, "main.cc"), *flags, f"-Wl,-rpath,{libdir}", "-o", str(exe)])
    assert sh([str(exe)]).stdout.startswith("consumer ok")


def test_installed_python_module_and_cli(prefix, tmp_path):
    site = glob.glob(os.path.join(prefix, "lib", "python3*", "dist-packages"))
    assert site, "the Python package was not installed"
    env = dict(os.environ, PYTHONPATH=site[0])
    code = "import kvserve, numpy as np; f = kvserve.encode(np.ones((1,2,1,8,8), np.float16), 'quant'); print(kvserve.__file__, len(f))"
    out = sh(["/usr/bin/python3", "-c", code], env=env, cwd=str(tmp_path)).stdout
    assert out.startswith(site[0]), out
    info = sh([os.path.join(prefix, "bin", "kvserve"), "info"]).stdout
    assert "simd:" in info and "quant" in info


def _pkg_binary(name):
    path = os.path.join(PKG_DIR, name)
    if not os.path.exists(path):
        pytest.skip(f"no portable build at {PKG_DIR} (scripts/package.sh makes it; scripts/test.sh runs it first)")
    return path


def test_portable_build_passes_its_kernel_suites_at_every_tier():
    tests = _pkg_binary("kvserve_tests")
    for simd in ("", "baseline"):
        env = dict(os.environ, KVSERVE_SIMD=simd)
        r = sh([tests, f"--gtest_filter={KERNEL_SUITES}"], env=env, timeout=900)
        assert "PASSED" in r.stdout and "FAILED" not in r.stdout, r.stdout[-2000:]


def test_portable_cli_runs_on_a_baseline_x86_64_cpu(tmp_path):
    cli = _pkg_binary("kvserve")
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-x86_64 (Debian's qemu-user) is not installed: no baseline CPU to run on")
    raw, mine = tmp_path / "x.kvf", tmp_path / "a.kvf"
    sh([CLI, "kv", "synth", "--shape", "llama3-8b", "--tokens", "64", "-o", str(raw)])
    spec = "prune(keep=0.5)|quant(kbits=4,vbits=4)|rans"
    sh([CLI, "codec", "encode", "-s", spec, "-i", str(raw), "-o", str(mine)])
    # qemu64: x86-64 with SSE2/SSE3 only (no AVX, F16C or FMA); Haswell: AVX2 without AVX-512.
    for cpu, tier in (("qemu64", "baseline"), ("Haswell", "avx2")):
        emulated = [qemu, "-cpu", cpu]
        info = sh([*emulated, cli, "info"], timeout=300).stdout
        assert f"simd: {tier} kernels (this CPU supports {tier}" in info, info
        # Frames made there equal the ones this machine's widest kernels make.
        theirs = tmp_path / f"{cpu}.kvf"
        sh([*emulated, cli, "codec", "encode", "-s", spec, "-i", str(raw), "-o", str(theirs)], timeout=600)
        assert mine.read_bytes() == theirs.read_bytes(), cpu
    tests = _pkg_binary("kvserve_tests")
    r = sh([qemu, "-cpu", "qemu64", tests, "--gtest_filter=CpuTier.*:Tiers/QuantKernelTiers.*:Tiers/DTypeTiers.*"],
           timeout=600)
    assert "PASSED" in r.stdout and "this CPU has no avx2" in r.stdout, r.stdout[-2000:]


def _debian_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("installing packages in a clean root needs root (chroot)")
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed (scripts/setup.sh installs it)")
    cache = os.path.join(PKG_DIR, "debian12-minbase.tar")
    root = tmp_path / "root"
    if not os.path.exists(cache):
        fresh = tmp_path / "fresh"
        r = sh(["debootstrap", "--variant=minbase", "bookworm", str(fresh), "http://deb.debian.org/debian"],
               timeout=1200, check=False)
        if r.returncode != 0:
            pytest.skip(f"debootstrap could not build a Debian 12 root here: {r.stderr.strip()[-300:]}")
        with tarfile.open(cache + ".part", "w") as t:
            t.add(str(fresh), arcname=".")
        os.replace(cache + ".part", cache)
        shutil.rmtree(fresh, ignore_errors=True)
    root.mkdir()
    with tarfile.open(cache) as t:
        t.extractall(str(root), numeric_owner=True)
    shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
    return root


def test_debs_install_and_run_in_a_clean_debian_root(tmp_path):
    debs = sorted(glob.glob(os.path.join(PKG_DIR, "packages", "*.deb")))
    if len(debs) != 3:
        pytest.skip(f"{len(debs)} packages in {PKG_DIR}/packages (scripts/package.sh makes the three)")
    root = _debian_root(tmp_path)
    (root / "debs").mkdir()
    for d in debs:
        shutil.copy(d, root / "debs")

    def chroot(cmd, timeout=600):
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C"}
        return sh(["chroot", str(root), "/bin/sh", "-c", cmd], timeout=timeout, env=env)

    r = chroot("apt-get update -qq && apt-get install -y -qq --no-install-recommends /debs/*.deb", timeout=1200)
    names = chroot("dpkg-query -W -f='${Package} ${Status}\\n' libkvserve-dev kvserve python3-kvserve").stdout
    assert names.count("install ok installed") == 3, names + r.stdout[-2000:]
    assert "simd:" in chroot("kvserve info").stdout
    ev = chroot("kvserve eval -m stories260K -s 'quant(kbits=4,vbits=4)' --contexts 2 --json", timeout=600).stdout
    assert '"relative_accuracy"' in ev
    py = chroot("cd / && python3 -c \"import kvserve, numpy as np; kv = np.ones((2,2,2,16,8), np.float16); "
                "print(kvserve.decode(kvserve.encode(kv, 'quant(kbits=4,vbits=4)|rans')).shape, kvserve.simd_tier())\"").stdout
    assert py.startswith("(2, 2, 2, 16, 8)"), py
    ldd = chroot("ldd $(dpkg -L libkvserve-dev | grep 'libkvserve.so$')").stdout
    assert "not found" not in ldd and "libzstd" in ldd, ldd
    assert chroot("test -f /usr/include/kvserve/codec.h && ls /usr/lib/*/cmake/kvserve/kvserveConfig.cmake "
                  "/usr/lib/*/pkgconfig/kvserve.pc").stdout.count("\n") == 2
