"""Source text of the two judge children (executed with ``python -I -S -c``).

:data:`CODEC` (plain-data encoding shared by both), :data:`CANDIDATE` (runs the model's
code, answers calls) and :data:`JUDGE` (runs the trusted tests, prints the verdict). Each
starts with :data:`consequence.sandbox.hardening.PRELUDE` and confines itself before it
reads anything. The protocol is described in :mod:`consequence.sandbox.judge`.
"""

from consequence.sandbox.hardening import PRELUDE

__all__ = ["CODEC", "CANDIDATE", "JUDGE"]

# Plain-data codec shared by both children (source text, executed in each).
# JSON natives: None, bool, int, float (incl. inf/nan), str, list. Tagged one-key objects:
# {"t": tuple}, {"d": [[k, v], ...]}, {"s": set}, {"z": frozenset}, {"b": hex bytes},
# {"c": [re, im]}. Exact types only: a subclass of int is NOT an int here.
CODEC = r'''
def _enc(v, d=0):
    t = type(v)
    if d > 100:
        raise ValueError("value nested deeper than 100")
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if t is list:
        return [_enc(e, d + 1) for e in v]
    if t is tuple:
        return {"t": [_enc(e, d + 1) for e in v]}
    if t is dict:
        return {"d": [[_enc(k, d + 1), _enc(e, d + 1)] for k, e in v.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "z": [_enc(e, d + 1) for e in v]}
    if t is bytes:
        return {"b": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    raise ValueError("not plain data: " + t.__name__)

def _dec(v, d=0):
    t = type(v)
    if d > 100:
        raise ValueError("value nested deeper than 100")
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if t is list:
        return [_dec(e, d + 1) for e in v]
    if t is not dict or len(v) != 1:
        raise ValueError("bad frame value")
    (tag, x), = v.items()
    if tag == "b" and type(x) is str:
        return bytes.fromhex(x)
    if type(x) is not list:
        raise ValueError("bad frame value")
    if tag == "t":
        return tuple(_dec(e, d + 1) for e in x)
    if tag == "d":
        out = {}
        for kv in x:
            if type(kv) is not list or len(kv) != 2:
                raise ValueError("bad dict item")
            out[_dec(kv[0], d + 1)] = _dec(kv[1], d + 1)
        return out
    if tag in ("s", "z"):
        s = {_dec(e, d + 1) for e in x}
        return s if tag == "s" else frozenset(s)
    if tag == "c" and len(x) == 2 and all(type(e) in (int, float) for e in x):
        return complex(x[0], x[1])
    raise ValueError("bad frame tag")

class _Frames:
    """Newline-delimited JSON frames over raw file descriptors (no Python buffering)."""
    def __init__(self, rfd, wfd, cap):
        self.rfd, self.wfd, self.cap, self.buf = rfd, wfd, cap, b""
    def send(self, obj):
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(self.wfd, data):]
    def recv(self):
        """The next frame as a dict; None on end of file, oversize or invalid JSON."""
        while b"\n" not in self.buf:
            if len(self.buf) > self.cap:
                return None
            chunk = os.read(self.rfd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return obj if type(obj) is dict else None
'''

CANDIDATE = (
    PRELUDE
    + CODEC
    + r"""
def _main():
    io = _Frames(0, 1, int(sys.argv[2]))
    first = io.recv()
    class Sink:
        def write(self, s):
            return len(s)
        def flush(self):
            pass
    sys.stdout = sys.stderr = Sink()
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(first["code"], "solution.py", "exec"), ns)
    except BaseException as e:
        io.send({"load_error": type(e).__name__ + ": " + str(e)[:200]}); os._exit(0)
    io.send({"ready": True})
    while True:
        req = io.recv()
        if req is None:
            os._exit(0)
        try:
            fn = ns[req["f"]]
        except KeyError:
            io.send({"x": ["NameError", "name '" + str(req["f"]) + "' is not defined"]}); continue
        try:
            res = fn(*_dec(req["a"]), **_dec(req["k"]))
        except BaseException as e:
            io.send({"x": [type(e).__name__, str(e)[:200]]}); continue
        try:
            out = {"r": _enc(res)}
        except BaseException as e:
            out = {"bad": type(res).__name__}
        io.send(out)
if __name__ == "__main__":  # a fresh interpreter; the fork server calls _apply and _main itself
    _harden(json.loads(sys.argv[1]))
    _main()
"""
)

JUDGE = (
    PRELUDE
    + CODEC
    + r"""
_w, _dumps, _exit, _repr = os.write, json.dumps, os._exit, repr
def _main():
    data = json.loads(sys.stdin.read())
    nonce = data["nonce"]
    def emit(obj):
        _w(1, ("\n" + nonce + _dumps(obj) + "\n").encode())
    emit({"stage": "loaded"})
    class Sink:
        def write(self, s):
            return len(s)
        def flush(self):
            pass
    sys.stdout = sys.stderr = Sink()
    io = _Frames(data["resp_fd"], data["req_fd"], data["cap"])
    bad = []  # hard failures of the candidate: every later check fails, caught or not
    calls = [0]
    class Gone(BaseException):
        pass
    class NonPlain(Exception):
        pass
    def lost(why):
        bad.append(why)
        raise Gone(why)
    def short(x):
        x = str(x)
        return x if len(x) <= 80 else x[:77] + "..."
    io.send({"code": data["code"]})
    hello = io.recv()
    if hello is None or hello.get("ready") is not True:
        why = hello.get("load_error") if isinstance(hello, dict) else None
        load_error = str(why) if why else "no answer"
    else:
        load_error = None
    def proxy(name):
        def candidate(*args, **kwargs):
            if bad:
                raise Gone(bad[0])
            try:
                req = {"f": name, "a": _enc(list(args)), "k": _enc(dict(kwargs))}
            except ValueError as e:
                emit({"judge_error": "argument cannot be sent: " + str(e)}); _exit(0)
            calls[0] += 1
            io.send(req)
            ans = io.recv()
            if ans is None:
                lost("candidate process ended or sent an invalid frame")
            if "r" in ans:
                try:
                    return _dec(ans["r"])
                except (ValueError, TypeError, RecursionError):
                    lost("candidate sent an invalid value")
            if "x" in ans and type(ans["x"]) is list and len(ans["x"]) == 2:
                cls = getattr(builtins, str(ans["x"][0]), None)
                if not (isinstance(cls, type) and issubclass(cls, Exception)):
                    cls = RuntimeError
                raise cls(str(ans["x"][1]))
            if "bad" in ans and data["mode"] == "cases":
                raise NonPlain("a " + short(ans["bad"]))
            lost("candidate returned a non-plain value")
        candidate.__name__ = name
        return candidate
    if data["mode"] == "cases":
        results, msgs = [], []
        ns = {"__builtins__": builtins}
        for name in data["names"]:
            ns[name] = proxy(name)
        for call, expected in data["cases"]:
            if load_error is not None:
                results.append(False); msgs.append(call + " not run: " + load_error); continue
            try:
                res = eval(call, dict(ns))
                good = _repr(res) == expected
                if not good:
                    msgs.append(call + " returned " + short(_repr(res)) + ", expected " + expected)
            except NonPlain as e:
                good = False
                msgs.append(call + " returned " + str(e) + ", expected " + expected)
            except Gone as e:
                good = False
                msgs.append(call + " failed: " + str(e))
            except BaseException as e:
                good = False
                msgs.append(call + " raised " + type(e).__name__ + ": " + short(e))
            results.append(bool(good) and not bad)
        emit({"results": results, "messages": msgs[:64], "error": load_error}); _exit(0)
    if load_error is not None:
        emit({"passed": False, "message": "candidate did not load: " + load_error}); _exit(0)
    ns = {"__name__": "__judge__", "__builtins__": builtins}
    try:
        exec(compile(data["setup"], "<setup>", "exec"), ns)
        exec(compile(data["check"], "<check>", "exec"), ns)
        check = ns["check"]
    except BaseException as e:
        emit({"judge_error": "test program did not load: " + type(e).__name__ + ": " + short(e)})
        _exit(0)
    candidate = ns[data["entry"]] = proxy(data["entry"])  # helpers may call it by name
    msg = None
    try:
        check(candidate)
    except BaseException as e:
        tb, line = e.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == "<check>":
                line = tb.tb_lineno
            tb = tb.tb_next
        msg = type(e).__name__ + (" at check line " + str(line) if line else "") + (
            ": " + short(e) if str(e) else "")
    if bad:
        msg = bad[0]
    emit({"passed": msg is None, "message": msg, "calls": calls[0]})
    _exit(0)
if __name__ == "__main__":  # a fresh interpreter; the fork server calls _apply and _main itself
    _harden(json.loads(sys.argv[1]))
    _main()
"""
)
