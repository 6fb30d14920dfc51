"""`pdserve` command line: `up`, `router`, `prefill`, `decode`, `planner`, `prepare`, `profile`, `plan`,
`bench`.

Every flag can also come from a YAML file (`--config`, keys = flag names with `_`) and from
`PDSERVE_<FLAG>` environment variables. Precedence: flag > environment > YAML > default.
Role mains are imported lazily so `pdserve router` never imports torch.
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
from dataclasses import fields
from typing import Any, Callable, Sequence

# Help texts quote the defaults of the typed settings each flag feeds (a test pins them);
# these modules import neither torch nor grpc.
from pdserve.bench import cli as bench_cli
from pdserve.common.errors import PdserveError
from pdserve.deploy import enroller, prepare, router_keys
from pdserve.deploy import up as up_defaults
from pdserve.deploy.supervisor import RestartPolicy
from pdserve.planner import cli as planner_cli
from pdserve.planner.settings import PlannerSettings
from pdserve.router.config import ROUTER_GRPC_PORT, ROUTER_HTTP_PORT, ROUTER_REGISTRY_PORT, RouterConfig
from pdserve.worker.settings import (DECODE_GRPC_PORT, DECODE_TRANSFER_PORT, PREFILL_GRPC_PORT,  # noqa: F401 - the
                                     WorkerSettings)  # chart test reads the ports here

TRANSFER_PORT = DECODE_TRANSFER_PORT
BENCHMARKS = tuple(bench_cli.BENCHMARKS)  # the one list, in bench/cli.py


def _shown(value: Any) -> str:
    return "none" if value in ("", None, ()) else str(value)


def _add_common(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--config", help="YAML file of flag values (keys are flag names with _)")
    _add_settings(p, role, "common")


def _add_table(p: argparse.ArgumentParser, table: type, role: str, group: str, title: str | None = None,
               default_of: Callable[[str], Any] | None = None) -> None:
    """The flags of `table`'s `group` that `role` takes, as the dataclass declares them
    (`common.flags.setting`); each help ends with the setting's real default."""
    g = p.add_argument_group(title or group) if group != "common" else p
    for f in fields(table):
        spec = f.metadata
        if spec.get("group") != group or role not in spec["roles"]:
            continue
        kw: dict[str, Any] = {"choices": spec["choices"] or None}
        if spec.get("repeated"):
            kw = {"action": "extend", "nargs": "+", "default": None}
        elif isinstance(f.default, bool):
            kw = {"action": "store_true", "default": None}
        elif isinstance(f.default, (int, float)):
            kw["type"] = type(f.default)
        default = default_of(f.name) if default_of else f.default
        shown = "" if isinstance(f.default, bool) else f" (default {_shown(default)})"
        g.add_argument("--" + f.name.replace("_", "-"), help=spec["help"] + shown, **kw)


def _add_settings(p: argparse.ArgumentParser, role: str, group: str, title: str | None = None) -> None:
    """WorkerSettings' flags of `group` for `role`, with the role's defaults."""
    _add_table(p, WorkerSettings, role, group, title, lambda name: WorkerSettings.default(role, name))


def _add_worker(p: argparse.ArgumentParser, role: str) -> None:
    """Flags of one worker process (`up` starts its own and takes only `_add_shared_worker`'s)."""
    _add_settings(p, role, "worker")
    _add_shared_worker(p, role)


def _add_shared_worker(p: argparse.ArgumentParser, role: str) -> None:
    """Flags that `up` passes to every worker it starts."""
    _add_settings(p, role, "engine")
    _add_settings(p, role, "kv transfer")
    _add_settings(p, role, "lifecycle")


def _add_up(sub) -> None:
    up = sub.add_parser("up", help="router + prefill + decode on this machine")
    _add_common(up, "prefill")
    _add_shared_worker(up, "prefill")
    up.add_argument("--num-prefill", type=int, help=f"prefill services (default {up_defaults.NUM_PREFILL})")
    up.add_argument("--num-decode", type=int, help=f"decode services (default {up_defaults.NUM_DECODE})")
    up.add_argument("--port", "--http-port", dest="http_port", type=int,
                    help=f"router HTTP port, the OpenAI API (default {ROUTER_HTTP_PORT})")
    up.add_argument("--router-grpc-port", type=int, help=f"router gRPC port (default {ROUTER_GRPC_PORT})")
    up.add_argument("--router-registry-port", type=int,
                    help=f"router's worker registry port (default {ROUTER_REGISTRY_PORT})")
    up.add_argument("--internal-host",
                    help="address the workers and the router's registry bind (default 127.0.0.1: only the "
                         "router's client ports follow --host)")
    up.add_argument("--local-prefill", action="store_true", default=None,
                    help="decode prefills every prompt itself (no prefill service)")
    up.add_argument("--ready-timeout-s", type=float,
                    help=f"how long to wait for all services (default {up_defaults.READY_TIMEOUT_S:g})")
    up.add_argument("--max-restarts", type=int,
                    help="a service that exits is restarted; one that exits more often than this within "
                         f"{RestartPolicy().window_s:g} s stops `up` (default {RestartPolicy().max_restarts})")
    _add_table(up, RouterConfig, "router", "routing", "router")
    _add_table(up, PlannerSettings, "up", "planner", "planner (scales workers to the SLO)")


def _add_router(sub) -> None:
    router = sub.add_parser("router", help="the OpenAI HTTP + gRPC front")
    router.add_argument("--config", help="YAML file of flag values (keys are flag names with _)")
    for group, title in (("common", None), ("listeners", None), ("routing", "routing and limits"),
                         ("workers", None)):
        _add_table(router, RouterConfig, "router", group, title)


def _dests(add: Callable[[argparse.ArgumentParser], None]) -> tuple[str, ...]:
    parser = argparse.ArgumentParser(add_help=False)
    add(parser)
    return tuple(a.dest for a in parser._actions)


def worker_pass_through() -> tuple[str, ...]:
    """The settings `up` hands to every worker it starts: exactly the flags it shares with
    them (`_add_shared_worker`), and the log level. Adding a flag there adds it here."""
    return (*_dests(lambda p: _add_shared_worker(p, "prefill")), "log_level")


def router_pass_through() -> tuple[str, ...]:
    """The router options `up` takes and hands to its router (RouterConfig's "routing" group)
    as flags; the API key goes in the environment instead (argv shows in ps)."""
    return tuple(d for d in _dests(lambda p: _add_table(p, RouterConfig, "router", "routing"))
                 if d != "api_key")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_router(sub)
    prefill = sub.add_parser("prefill", help="one prefill service")
    _add_common(prefill, "prefill")
    _add_worker(prefill, "prefill")
    decode = sub.add_parser("decode", help="one decode service")
    _add_common(decode, "decode")
    _add_worker(decode, "decode")
    planner = sub.add_parser("planner", help="the live planner in a Kubernetes cluster: scales the prefill and "
                             "decode Deployments to the SLO")
    planner.add_argument("--config", help="YAML file of flag values (keys are flag names with _)")
    planner.add_argument("--host", help="address its metrics listener binds (default 127.0.0.1; the chart sets listenHost)")
    planner.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    _add_table(planner, PlannerSettings, "planner", "planner", "planner")
    _add_table(planner, PlannerSettings, "planner", "kubernetes", "kubernetes")
    prepare.add_parser(sub)
    router_keys.add_parser(sub)
    enroller.add_parsers(sub)
    planner_cli.add_profile_parser(sub)
    planner_cli.add_plan_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    bench.add_argument("what", choices=BENCHMARKS)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    return parser


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Merge YAML < PDSERVE_* environment < flags into one dict of settings. A YAML key or
    value the command's flags would refuse exits with one line naming the file, the key and
    (for a misspelt key) the closest one."""
    from pdserve.common import envs

    merged: dict[str, Any] = {}
    known = set(vars(args))
    actions = _flag_actions(getattr(args, "command", None))
    if getattr(args, "config", None):
        merged.update(_read_config(args.config, known, actions))
    for key, value in envs.prefixed(environ).items():
        if key in known:
            merged[key] = _convert(actions.get(key), value, f"PDSERVE_{key.upper()}={value!r}")
    merged.update({k: v for k, v in vars(args).items() if v is not None})
    return merged


def _read_config(path: str, known: set[str], actions: dict[str, argparse.Action]) -> dict[str, Any]:
    import difflib

    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"pdserve: {path}: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise SystemExit(f"pdserve: {path}: expected a mapping of flag names to values")
    out = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in known or key in ("command", "config"):
            close = difflib.get_close_matches(key, sorted(known - {"command", "config"}), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SystemExit(f"pdserve: {path}: unknown setting {raw_key!r}{hint}")
        out[key] = _convert(actions.get(key), value, f"{path}: {raw_key}: {value!r}")
    return out


def _convert(action: argparse.Action | None, value: Any, where: str) -> Any:
    """`value` as the flag's own type and choices would take it; SystemExit naming `where`."""
    if action is None:
        return value
    if action.const is True:  # a switch
        if isinstance(value, bool):
            return value
        return str(value).strip().lower() in ("1", "true", "yes", "on")
    try:
        converted = action.type(value) if action.type is not None else value
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number"}.get(action.type, "a valid value")
        raise SystemExit(f"pdserve: {where} is not {kind}") from None
    if action.choices and converted not in action.choices:
        raise SystemExit(f"pdserve: {where} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _flag_actions(command: str | None) -> dict[str, argparse.Action]:
    """dest -> the argparse action of that flag of `command`."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    role = sub.choices.get(command) if command else None
    return {a.dest: a for a in (role._actions if role else ()) if a.dest != "help"}


def _role_main(command: str) -> Callable[[dict[str, Any]], int]:
    if command == "up":
        from pdserve.deploy.up import main as fn
    elif command == "router":
        from pdserve.router.main import main as fn
    elif command == "prefill":
        from pdserve.prefill.main import main as fn
    elif command == "decode":
        from pdserve.decode.main import main as fn
    elif command == "planner":
        from pdserve.planner.kube import main as fn
    else:
        raise SystemExit(f"pdserve: unknown command {command}")
    return fn


def _transfer_probe(backends: list[str]):
    """`pdserve profile`'s link measurement: `bench transfer`'s, run when the profile asks."""
    def probe():
        from pdserve.bench.transfer import links
        from pdserve.planner.profile import TransferCost

        return [TransferCost(name, rate, tail) for name, rate, tail in links(backends)]
    return probe


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from pdserve.bench.cli import main as bench_main

        return bench_main(args.what, args.rest)
    if args.command == "prepare":
        return prepare.main(args)
    if args.command == "router-keys":
        return router_keys.main(args)
    if args.command in ("enroller", "enroll", "enrollment-keygen"):
        return enroller.main(args)
    if args.command == "plan":
        return planner_cli.run_plan(args)
    if args.command == "profile":
        return planner_cli.run_profile(args, _transfer_probe)
    settings = resolve(args)
    # a crash in native code (a kernel, UCX, gloo) prints every thread's Python stack on the
    # service's stderr instead of leaving only an exit status of -11
    if sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    try:
        return _role_main(args.command)(settings) or 0
    except PdserveError as exc:  # a setting it cannot take, a model it cannot load: one line
        print(f"pdserve {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
