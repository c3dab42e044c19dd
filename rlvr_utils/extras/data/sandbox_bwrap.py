"""bubblewrap (https://github.com/containers/bubblewrap, Debian's `bubblewrap`) for the code task's sandbox
(sandbox.py): the command line of one sandbox, whether it can start here (one line naming what is missing if not),
and ending one with everything it started.

One sandbox: its own pid, network, mount, IPC and UTS namespaces; a read-only view of /usr and the interpreter's
prefixes and nothing else of the host (no /proc, /etc, /home or working tree); a private tmpfs of bounded size as the
only writable place; no capabilities; a session of its own (no terminal to push input into); it dies with the process
that started it (--die-with-parent). As root there is no user namespace: the harness switches to a user id of the
sandbox's own (`sandbox_uid`), so that RLIMIT_NPROC counts (the kernel never counts root's processes) and no sandbox
can signal another's; as anyone else, a user namespace of its own (and, bubblewrap >= 0.8, no nested ones).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def python_dirs() -> list[str]:
    """What the sandbox sees of the host, read-only: /usr and the interpreter's prefixes (a venv's and its base's)."""
    dirs = ["/usr"]
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        for d in dict.fromkeys([os.path.abspath(p), os.path.realpath(p)]):
            if d != "/" and not any(d == k or d.startswith(k + "/") for k in dirs):
                dirs.append(d)
    return dirs


UID_BASE = 2_000_000_000  # as root under bwrap: each sandbox runs as a user id of its own from here (no name, no files)
_SLOTS = itertools.count()


def sandbox_uid() -> int:
    """A user id for one sandbox (as root under bwrap), so that RLIMIT_NPROC counts its processes alone (the kernel
    counts a limit per user) and no sandbox can signal another's. 128 at a time per trainer process."""
    return UID_BASE + (os.getpid() % (1 << 20)) * 128 + next(_SLOTS) % 128


@functools.cache
def version() -> tuple[int, ...]:
    """bubblewrap's version, (0,) when `bwrap --version` does not say."""
    try:
        out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return (0,)


@functools.cache
def command(disk_mb: int = 64) -> tuple[str, ...]:
    """bwrap's arguments for one sandbox, up to the command (bwrap(1)). As root: no user namespace, so the harness
    drops to the sandbox's own user id and RLIMIT_NPROC counts (the kernel never counts root's); as anyone else: a user
    namespace of its own, and (bubblewrap >= 0.8) no nested ones."""
    cmd = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    cmd += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if os.geteuid() == 0:
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]  # for the harness's switch of user, then none
    else:
        cmd += ["--unshare-user", *(["--disable-userns"] if version() >= (0, 8) else [])]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged /usr: links; else directories
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    cmd += ["--dev", "/dev", "--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", "/tmp"]  # before the binds:
    made = {"/", "/tmp"}  # a venv under /tmp (CI's) is bound onto the tmpfs, not hidden by it
    for d in python_dirs():
        parents = [p for p in Path(d).parents if str(p) not in made][::-1]
        for p in parents:  # bwrap makes missing parents 0700: no one else could pass
            cmd += ["--perms", "0755", "--dir", str(p)]
            made.add(str(p))
        cmd += ["--ro-bind", d, d]
        made.add(d)
    if os.path.exists("/etc/ld.so.cache"):
        cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    cmd += ["--chdir", "/tmp"]
    env = dict(PATH="/usr/bin:/bin", HOME="/tmp", TMPDIR="/tmp", LANG="C.UTF-8")
    cmd += ["--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)], "--"]
    return tuple(cmd)


INSTALL = "apt-get install bubblewrap (Debian, Ubuntu; dnf install bubblewrap on Fedora)"
USERNS = (
    "unprivileged user namespaces are off: sysctl kernel.unprivileged_userns_clone=1 (Debian) or "
    "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 24.04), user.max_user_namespaces > 0; in Docker, "
    "--security-opt seccomp=unconfined or a run as root"
)
WEAKER = (
    "or pass --code-sandbox audit-hook to accept the weaker in-process sandbox (no OS isolation; not a security "
    "boundary)"
)


@functools.cache
def problem() -> str | None:
    """None when bubblewrap can run programs here; else one line naming what is missing and how to get it. Runs bwrap
    once (cached): the same command a program gets, and as root the harness's switch to a user id of its own."""
    head = "--task code runs each program in bubblewrap (bwrap)"
    if shutil.which("bwrap") is None:
        return f"{head}, which is not installed: {INSTALL}, {WEAKER}"
    probe = "import os\nif os.geteuid() == 0:\n    os.setgroups([])\n"
    probe += f"    os.setgid({UID_BASE})\n    os.setuid({UID_BASE})\n"
    probe += "import json, resource, encodings.idna\nopen('/tmp/probe', 'w').write('x')\n"
    try:
        r = subprocess.run(
            [*command(), sys.executable, "-I", "-S", "-c", probe],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{head}, which did not start: {e}; {WEAKER}"
    if r.returncode == 0:
        return None
    lines = r.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {r.returncode}"]
    why = lines[-1].strip()
    if "Unknown option" in why:
        hint = f"bubblewrap {'.'.join(map(str, version()))} is too old: 0.8 or newer (Debian 12, Ubuntu 24.04)"
    elif "execvp" in why:
        hint = f"the sandbox shows /usr and the interpreter's prefixes, and {sys.executable} is not under them"
    elif why.startswith("bwrap:") and os.geteuid() != 0:
        hint = USERNS
    elif not why.startswith("bwrap:"):
        where = f"chmod -R o+rX {sys.base_prefix}, or run as a user"
        hint = (
            f"the programs run as a user of their own, who must be able to read its Python ({sys.executable}): {where}"
        )
    else:
        hint = (
            "as root, bubblewrap needs CAP_SYS_ADMIN to make namespaces (in Docker: --cap-add SYS_ADMIN --security-opt "
            "seccomp=unconfined, or --privileged), or run as a user where user namespaces are on"
        )
    return f"{head}, which cannot start here ({why}): {hint}; {WEAKER}"


def init_pidfd(proc: subprocess.Popen, info: int) -> int | None:
    """A pidfd of the sandbox's init, read from bwrap's --info-fd (`{"child-pid": N}`), so that the kill can wait
    until the init has ended, which the kernel lets happen only after every other process of its pid namespace."""
    data, deadline = b"", time.time() + 5
    try:
        while b"}" not in data and select.select([info], [], [], max(0.0, deadline - time.time()))[0]:
            chunk = os.read(info, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(info)
    try:
        pid = int(json.loads(data)["child-pid"])
        fd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError, AttributeError):
        return None
    try:  # still bwrap's child, not a process that got the number after it ended
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = -1
    if ppid != proc.pid:
        os.close(fd)
        return None
    return fd


def kill_init(pidfd: int) -> None:
    """SIGKILL a sandbox's init and wait until it has ended: the kernel first ends every other process of its pid
    namespace, a child in a session of its own too. Closes the pidfd."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], 5)  # readable once the init has ended
    except OSError:
        pass
    os.close(pidfd)
