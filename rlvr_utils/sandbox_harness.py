"""The sandbox harness: the program `sandbox.run_code_tests` starts with `python -I -c <this file's text>`.

It reads one JSON request from stdin (nonce, private pipe fd, program, setup, tests, entry point, rlimits), closes
stdin, leaves the network (a new network namespace where the kernel allows it), applies the rlimits, drops to user
`nobody` when started as root, installs an audit hook that allows a list of events (running and importing code,
reads, file operations inside the working directory) and refuses every other (fork/exec/subprocess, sockets, ctypes,
sqlite3, writes outside the working directory, /proc and frame introspection, ...), then runs the program and each
test, writing `<nonce>:pass:<i>` to the private pipe after test i returns. Everything lives inside `_run()`
(closures, not module globals), so the program cannot reach the harness's state through `sys.modules["__main__"]`.
NOT A SECURITY BOUNDARY: see sandbox.py.
"""

import json
import os
import resource
import sys


def _run():
    data = b""
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    p = json.loads(data)
    nonce, out, work = p["nonce"], p["fd"], os.getcwd()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    net = False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        net = libc.unshare(0x40000000) == 0 or libc.unshare(0x50000000) == 0  # CLONE_NEWNET, +CLONE_NEWUSER
    except Exception:
        pass
    for name, value in p["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass

    def world_readable(path):  # nobody must still import the stdlib after the switch
        while True:
            if os.stat(path).st_mode & 0o005 != 0o005:
                return False
            if path == os.path.dirname(path):
                return True
            path = os.path.dirname(path)

    if os.geteuid() == 0 and world_readable(os.path.dirname(os.__file__)):
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        except OSError:
            pass
    os.write(out, ("%s:start:%d:%d\n" % (nonce, net, os.geteuid())).encode())
    sys.dont_write_bytecode = True
    # An allow-list of audit events (https://docs.python.org/3/library/audit_events.html), not a block-list: an event
    # not named here is refused, so a call that writes or starts something under an event nobody listed (as
    # sqlite3.connect did: a database, or one ATTACHed later, is a file anywhere) is refused rather than missed.
    # Allowed: what running and importing code raises, reads (open is checked below), listing directories, sleeping,
    # threads, the environment of this process, and file operations whose paths all lie in the working directory.
    # Not allowed, among the rest: fork/exec/spawn/subprocess, signals to other processes, sockets and every network
    # client, ctypes, sqlite3, mmap, rlimits, tracing, gc and frame introspection, links, chown, the debugger.
    free = {
        "import",
        "exec",
        "compile",
        "code.__new__",
        "function.__new__",
        "marshal.load",
        "marshal.loads",
        "marshal.dumps",
        "builtins.id",
        "builtins.input",
        "builtins.input/result",
        "object.__setattr__",
        "object.__delattr__",
        "os.listdir",
        "os.scandir",
        "glob.glob",
        "glob.glob/2",
        "time.sleep",
        "array.__new__",
        "pickle.find_class",
        "sys._getframemodulename",
        "sys.excepthook",
        "sys.unraisablehook",
        "os.putenv",
        "os.unsetenv",
        "_thread.start_new_thread",
        "cpython._PySys_ClearAuditHooks",
    }
    frame_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
    path_events = {  # allowed when each path among their first two arguments lies in the working directory
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.rename",
        "os.truncate",
        "os.chmod",
        "os.utime",
        "os.chdir",
        "os.mkfifo",
        "shutil.rmtree",
        "shutil.copyfile",
        "shutil.copymode",
        "shutil.copystat",
        "shutil.copytree",
        "shutil.move",
        "tempfile.mkstemp",
        "tempfile.mkdtemp",
    }

    def inside(path):
        return isinstance(path, int) or os.path.abspath(os.fsdecode(path)).startswith(work + os.sep)

    def hook(event, args):
        if event in free:
            return
        if event == "sys._getframe":
            raise ValueError("sandbox: frames are not available")  # the stdlib's fallback for shallow stacks
        if event == "object.__getattr__":
            if args[1] in frame_attrs:
                raise AttributeError("sandbox: %s is not available" % args[1])
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            name = os.path.abspath(os.fsdecode(path))
            if name.startswith("/proc") or name.startswith("/dev/mem"):
                raise PermissionError("sandbox: %s is not readable" % name)
            write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
            writes = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & write_flags
            if writes and not inside(path):
                raise PermissionError("sandbox: writing %s outside the working directory" % name)
            return
        if event in path_events:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError("sandbox: %s on %s outside the working directory" % (event, a))
            return
        raise PermissionError("sandbox: %s is not allowed" % event)

    sys.addaudithook(hook)
    os.dup2(null, 1)
    os.dup2(null, 2)
    plain_types, _type, _id, _all = (
        (int, float, complex, bool, str, bytes, type(None), list, tuple, dict, set, frozenset),
        type,
        id,
        all,
    )  # captured before the program can patch builtins

    def plain(x, path, budget):  # exact builtin types all the way down: no object can redefine == (always-equal hack)
        t = _type(x)
        budget[0] -= 1
        if t not in plain_types or budget[0] < 0:
            return False
        if t in (list, tuple, set, frozenset, dict):
            if _id(x) in path:  # a cycle; shared sub-objects ([[0] * 3] * 3) are fine
                return False
            path.add(_id(x))
            ok = _all(plain(v, path, budget) for v in ([v for kv in x.items() for v in kv] if t is dict else x))
            path.discard(_id(x))
            return ok
        return True

    def guard(fn):
        def checked(*args, **kwargs):
            result = fn(*args, **kwargs)
            if not plain(result, set(), [10**7]):
                raise TypeError("sandbox: the entry point returned a non-builtin value")
            return result

        return checked

    g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(p["program"], "<solution>", "exec"), g)
        t = dict(g)  # the tests' namespace: the program's own code cannot rebind names in it
        if p["entry_point"]:
            t[p["entry_point"]] = t["candidate"] = guard(g[p["entry_point"]])
        exec(compile(p["setup"], "<test setup>", "exec"), t)
    except BaseException:
        return
    for i, test in enumerate(p["tests"]):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), t)
        except BaseException:
            continue
        os.write(out, ("%s:pass:%d\n" % (nonce, i)).encode())


if __name__ == "__main__":  # python -I -c <this file>: the whole run happens inside _run()
    _run()
    os._exit(0)
