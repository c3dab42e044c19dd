"""The sandbox harness: the program `sandbox.run_code_tests` starts twice for each program it verifies, as
`python -I -S -c <this file's text>`, each copy in a sandbox of its own (bubblewrap's namespaces; with
`--code-sandbox audit-hook`, only the audit hook and rlimits below):

- role "program" runs the model's code, then answers the calls that the tests make of its top-level names (call,
  read or set an attribute) over a pair of pipes. Each argument and each answer crosses as plain data, exact builtin
  types all the way down (int float complex bool str bytes None list tuple dict set frozenset, no cycles); any other
  object stays in the program as a numbered reference.
- role "tests" runs the dataset's tests with the program's top-level names bound to those answers and references,
  and writes `pass <i>` to its stdout after test i returns. Only the trainer holds the other end of that stdout.

So the verdict comes from a process the program cannot reach: all the program can do is answer calls, and an answer
is data that the tests compare. An object whose `==` is always true stays a reference, and a reference equals
nothing but itself (the always-equal reward hack); exit codes, printed text and writes to any file descriptor the
program holds reach no one who counts passes.

Both read one JSON request from stdin, then: put site-packages on the path, leave the network (bwrap already did;
else a new network namespace where the kernel allows it), drop root (under bwrap to a user id of the sandbox's own,
else to `nobody`), apply the rlimits, and install an audit hook that allows a list of events and refuses every other
(fork/exec/subprocess, sockets, ctypes, writes outside the working directory, /proc, ...). Under bwrap the hook and
the rlimits are a second layer; without it they are the only one, and a program that gets past the hook (native
code, an interpreter bug, an unaudited call) is out.
"""

import builtins
import json
import os
import resource
import sys

LINE_LIMIT = 1 << 26  # bytes of one answer the tests read (64 MiB); a longer one fails the call
SCALARS = (type(None), bool, int, float, str)
TAGS = {tuple: "t", set: "s", frozenset: "f"}


def encode(x, ref, budget=None, path=None):
    """x as JSON-ready data: exact builtin scalars as they are, bytes and complex and the containers tagged
    ({"b": ...}, {"c": [re, im]}, {"t": [...]}, {"s": [...]}, {"f": [...]}, {"d": [[k, v], ...]}), lists as lists,
    and any other object as ref(x) (the program: a numbered reference; the tests: refused). Cycles and more than
    10**6 values raise ValueError. Exact types only, so no object of the program's can redefine what it sends."""
    budget = [10**6] if budget is None else budget
    path = set() if path is None else path
    t = type(x)
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError("sandbox: a value of more than 10**6 parts")
    if t in SCALARS:
        return x
    if t is bytes:
        return {"b": x.decode("latin-1")}
    if t is complex:
        return {"c": [x.real, x.imag]}
    if t not in (list, tuple, set, frozenset, dict):
        return ref(x)
    if id(x) in path:  # a cycle; shared sub-objects ([[0] * 3] * 3) are sent once per use
        raise ValueError("sandbox: a cyclic value")
    path.add(id(x))
    if t is dict:
        items = [[encode(k, ref, budget, path), encode(v, ref, budget, path)] for k, v in x.items()]
    else:
        items = [encode(v, ref, budget, path) for v in x]
    path.discard(id(x))
    return items if t is list else {"d": items} if t is dict else {TAGS[t]: items}


def decoder(lookup):
    """json.loads' object_hook for encode's tags; {"r": n} becomes lookup(n); any other object is refused."""

    def hook(d):
        if len(d) != 1:
            raise ValueError("sandbox: not a value")
        ((tag, v),) = d.items()
        if tag == "b" and type(v) is str:
            return v.encode("latin-1")
        if tag == "c" and type(v) is list and len(v) == 2:
            return complex(*v)
        if tag == "t" and type(v) is list:
            return tuple(v)
        if tag == "s" and type(v) is list:
            return set(v)
        if tag == "f" and type(v) is list:
            return frozenset(v)
        if tag == "d" and type(v) is list and all(type(kv) is list and len(kv) == 2 for kv in v):
            return dict(map(tuple, v))
        if tag == "r" and type(v) is int:
            return lookup(v)
        raise ValueError("sandbox: not a value")

    return hook


def send(fd, message):
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def world_readable(path):  # nobody must still import the stdlib after the switch
    while True:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def harden(p):
    """Leave the network, drop root (to nobody; under bwrap to a user of this sandbox's own), apply the rlimits,
    install the audit hook. Returns (network isolated, uid). Under bwrap as root the drop must succeed (an OSError
    ends the run before any verdict)."""
    import ctypes  # before the hook, which refuses its dlopen: numpy imports it (its calls stay refused)

    net = p["isolated"]
    if not net:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            net = libc.unshare(0x40000000) == 0 or libc.unshare(0x50000000) == 0  # CLONE_NEWNET, +CLONE_NEWUSER
        except Exception:
            pass
    if os.geteuid() == 0 and (p["isolated"] or world_readable(os.path.dirname(os.__file__))):
        try:
            os.setgroups([])
            os.setgid(p["uid"])
            os.setuid(p["uid"])
        except OSError:
            if p["isolated"]:
                raise
    for name, value in p["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass
    sys.dont_write_bytecode = True
    sys.addaudithook(audit_hook(os.getcwd()))
    return net, os.geteuid()


def audit_hook(work):
    # An allow-list of audit events (https://docs.python.org/3/library/audit_events.html), not a block-list: an event
    # not named here is refused, so a call that writes or starts something under an event nobody listed (as
    # sqlite3.connect did: a database, or one ATTACHed later, is a file anywhere) is refused rather than missed.
    # Allowed: what running and importing code raises, reads (open is checked below), listing directories, sleeping,
    # threads, the environment of this process, and file operations whose paths all lie in the working directory.
    # Not allowed, among the rest: fork/exec/spawn/subprocess, signals to other processes, sockets and every network
    # client, ctypes, sqlite3, mmap, rlimits, tracing, gc and frame introspection, links, chown, the debugger.
    # Not every way out raises an event (_posixsubprocess.fork_exec raises none): under bwrap that is contained by
    # the namespaces; without it, it is the hole that makes --code-sandbox audit-hook no security boundary.
    free = set(  # running and importing code, reads, listing, sleeping, threads, this process's environment
        "import exec compile code.__new__ function.__new__ marshal.load marshal.loads marshal.dumps builtins.id "
        "builtins.input builtins.input/result object.__setattr__ object.__delattr__ os.listdir os.scandir glob.glob "
        "glob.glob/2 time.sleep array.__new__ pickle.find_class sys._getframemodulename sys.excepthook "
        "sys.unraisablehook os.putenv os.unsetenv _thread.start_new_thread cpython._PySys_ClearAuditHooks".split()
    )
    frame_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
    path_events = set(  # allowed when each path among their first two arguments lies in the working directory
        "os.remove os.rmdir os.mkdir os.rename os.truncate os.chmod os.utime os.chdir os.mkfifo shutil.rmtree "
        "shutil.copyfile shutil.copymode shutil.copystat shutil.copytree shutil.move tempfile.mkstemp "
        "tempfile.mkdtemp".split()
    )

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
            name = os.path.realpath(os.fsdecode(path))  # /dev/fd/../../self/mem is /proc/self/mem
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

    return hook


def serve_program(p):
    """The program's side: run it, send the top-level names the tests ask for, then answer each request until the
    tests hang up."""
    requests, replies, refs = os.fdopen(p["requests"], "rb"), p["replies"], []

    def ref(x):
        refs.append(x)
        return {"r": len(refs) - 1}

    g = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(p["program"], "<solution>", "exec"), g)
    except BaseException as e:
        send(replies, ["error", type(e).__name__])
        return
    wanted = json.loads(requests.readline() or "[]")  # the first request: ["names", the names the tests use]
    names = []
    for k in wanted[1] if len(wanted) == 2 and type(wanted[1]) is list else ():
        if k not in g or k.startswith("__"):
            continue
        v = g[k]
        if type(v) is type(sys):
            names.append([k, "module", v.__name__])
        else:
            try:
                names.append([k, "value", encode(v, ref)])
            except (ValueError, RecursionError):
                names.append([k, "value", ref(v)])
    send(replies, ["names", names])
    args = decoder(refs.__getitem__)
    for line in requests:
        try:
            op, n, *rest = json.loads(line, object_hook=args)
            if op == "call":
                value = refs[n](*rest[0], **rest[1])
            elif op == "getattr":
                value = getattr(refs[n], rest[0])
            else:
                value = setattr(refs[n], rest[0], rest[1])
            answer = ["value", encode(value, ref)]
        except BaseException as e:
            answer = ["raise", type(e).__name__]
        send(replies, answer)


def run_tests(p, out):
    """The tests' side: bind the program's names, run the setup and each test, write `pass <i>` after test i."""
    import importlib

    requests, replies, proxies, broken = p["requests"], os.fdopen(p["replies"], "rb"), {}, []

    class ProgramError(Exception):
        """The program raised an exception that is not a builtin one, or its answers stopped making sense."""

    class Remote:
        """An object that stays in the program: it can be called and its attributes read and set; it has no truth
        value, and it equals only itself."""

        __slots__ = ("_ref",)

        def __call__(self, *args, **kwargs):
            return ask("call", self._ref, encode(list(args), tag), encode(kwargs, tag))

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return ask("getattr", self._ref, name)

        def __setattr__(self, name, value):
            ask("setattr", self._ref, name, encode(value, tag))

        def __bool__(self):
            raise TypeError("sandbox: an object of the program's has no truth value here")

        def __repr__(self):
            return "<the program's object %d>" % self._ref

    def proxy(n):
        if n not in proxies:
            proxies[n] = object.__new__(Remote)
            object.__setattr__(proxies[n], "_ref", n)
        return proxies[n]

    def tag(x):
        if type(x) is Remote:
            return {"r": x._ref}
        raise TypeError("sandbox: only plain values and the program's own objects can be passed to it")

    def read():
        if broken:
            raise ProgramError("the program stopped answering")
        line = replies.readline(LINE_LIMIT)
        try:
            if not line.endswith(b"\n"):
                raise ValueError("sandbox: no answer, or one longer than the limit")
            message = json.loads(line, object_hook=decoder(proxy))
            if type(message) is not list or not message or type(message[0]) is not str:
                raise ValueError("sandbox: not an answer")
            return message
        except (ValueError, TypeError, RecursionError, MemoryError):
            broken.append(True)
            raise ProgramError("the program's answer is not a value") from None

    def ask(*request):
        send(requests, list(request))
        if request[0] == "names":  # the first answer, whole
            return read()
        kind, *rest = read()
        if kind == "value" and len(rest) == 1:
            return rest[0]
        error = ProgramError(str(rest[0])[:100] if rest else kind)
        cls = getattr(builtins, rest[0], None) if kind == "raise" and len(rest) == 1 and type(rest[0]) is str else None
        # a builtin exception is raised here as the program raised it; StopIteration would end a caller's loop early
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopIteration):
            try:
                error = cls("raised in the program")
            except Exception:
                pass
        raise error

    code = []
    for i, text in enumerate([p["setup"], *p["tests"]]):
        try:
            code.append(compile(text, "<test %d>" % (i - 1) if i else "<test setup>", "exec"))
        except BaseException:  # a test that does not compile fails (the setup: every test)
            code.append(None)
    used, todo = {p["entry_point"]} - {None}, [c for c in code if c is not None]
    while todo:  # the global names the tests use, in nested functions too
        c = todo.pop()
        used.update(c.co_names)
        todo += [k for k in c.co_consts if type(k) is type(c)]
    try:
        kind, *rest = ask("names", sorted(used))
    except (ProgramError, OSError):
        return
    if kind != "names" or len(rest) != 1 or type(rest[0]) is not list:
        return  # the program raised (or never finished): no test passes
    t, values = {"__name__": "__main__", "__builtins__": builtins}, {}
    for item in rest[0]:
        if type(item) is not list or len(item) != 3 or type(item[0]) is not str:
            continue
        name, kind, value = item
        values[name] = value
        if name not in used or name.startswith("__") or hasattr(builtins, name):
            continue  # the program cannot rebind a builtin the tests use (all, abs, ...)
        module = name if name in sys.stdlib_module_names else value if kind == "module" else None
        if module is None:
            t[name] = value
        elif type(module) is str and module.split(".")[0] in sys.stdlib_module_names:
            try:  # this process's own copy: the program cannot hand the tests a `math` of its own
                t[name] = importlib.import_module(module)
            except Exception:
                pass
    entry = p["entry_point"]
    try:
        if entry:
            t[entry] = t["candidate"] = values[entry]
        exec(code[0], t)
    except BaseException:
        return
    for i, test in enumerate(code[1:]):
        try:
            exec(test, t)  # None (it did not compile): a TypeError, a failure
        except BaseException:
            continue
        os.write(out, ("pass %d\n" % i).encode())


def main():
    data = b""
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    p = json.loads(data)
    sys.path.extend(p["path"])  # site-packages, without running their .pth files (python -S)
    null = os.open(os.devnull, os.O_RDWR)
    out = os.dup(1)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if p["role"] == "program":
        os.close(out)
        harden(p)
        serve_program(p)
    else:
        net, uid = harden(p)
        os.write(out, ("start %d %d\n" % (net, uid)).encode())
        run_tests(p, out)


if __name__ == "__main__":  # python -I -S -c <this file>
    main()
    os._exit(0)
