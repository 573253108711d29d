"""`spindle --help` a person can read: the flags grouped by concern, a short form that fits a screen (the flags most
starts need), `--help=all` for every flag and `--help=GROUP` for one group (vLLM's form); and a mistyped flag
answered in one line naming the closest one, not the whole usage."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

# group -> its title in --help (the order --help shows them in)
GROUPS: dict[str, str] = {
    "model": "model: what is served and how it is read",
    "serving": "serving: address, TLS, keys, HTTP",
    "scheduling": "scheduling: batches, KV cache, queues, threads",
    "api": "API: request limits, tools, reasoning, images, audio",
    "parallel": "parallel: tensor and data parallel, API processes, nodes",
    "lora": "LoRA adapters",
    "speculative": "speculative decoding",
    "multi-model": "multi-model: a folder of models",
    "logging": "logging and metrics",
}
_FLAG_GROUPS: dict[str, list[str]] = {
    "model": (
        "--model --served-model-name --tokenizer --max-model-len --dtype --quantization --generation-config "
        "--chat-template --trust-request-chat-template --runner --convert --pooler-config --device"
    ).split(),
    "serving": (
        "--host --port --api-key --ssl-keyfile --ssl-certfile --allowed-origins --allowed-methods --allowed-headers "
        "--allow-credentials --root-path --worker-class --shutdown-timeout --socket-send-buffer --max-request-body "
        "--sse-keepalive --disable-ui"
    ).split(),
    "scheduling": (
        "--max-num-seqs --max-num-batched-tokens --max-num-queued-reqs --max-num-queued-tokens --scheduling-policy "
        "--block-size --kv-cache-memory --num-blocks --no-enable-prefix-caching --stream-interval --seed --cpu-threads "
        "--kv-disk-cache-size --state-snapshot-interval --state-snapshot-memory"
    ).split(),
    "api": (
        "--max-logprobs --renderer-num-workers --chat-template-render-timeout --responses-store-size "
        "--responses-store-max-bytes --max-prompts-per-request --max-documents-per-request --max-choices-per-request "
        "--max-stop-strings --max-stop-string-length --max-stop-token-ids --max-logit-bias --max-allowed-token-ids "
        "--max-structured-output-size --tool-call-parser --enable-auto-tool-choice --reasoning-parser "
        "--limit-mm-per-prompt --allowed-media-domains --mm-processor-cache-gb --max-audio-filesize-mb "
        "--max-audio-duration-s --batch-dir --batch-max-file-bytes --batch-max-in-flight"
    ).split(),
    "parallel": (
        "--tensor-parallel-size --nnodes --node-rank --master-addr --master-port --headless --api-server-count "
        "--data-parallel-size --data-parallel-policy"
    ).split(),
    "lora": "--enable-lora --lora-modules --max-loras --max-lora-rank --max-cpu-loras --lora-dtype".split(),
    "speculative": ["--speculative-config"],
    "multi-model": "--models-dir --max-loaded-models --model-idle-timeout".split(),
    "logging": "--log-level --log-requests --metrics-public --metrics-compat".split(),
}
# flag -> its group; a flag named nowhere shows under "serving" (tests/server/test_cli_help.py keeps this complete)
GROUP_OF: dict[str, str] = {flag: group for group, flags in _FLAG_GROUPS.items() for flag in flags}
# the flags the short --help shows: what most starts need
COMMON = frozenset(
    "--model --served-model-name --max-model-len --dtype --generation-config --host --port --api-key --max-num-seqs "
    "--kv-cache-memory --tool-call-parser --api-server-count --data-parallel-size --models-dir --log-level".split()
)
MODEL_HELP = (
    "a Hugging Face checkpoint folder, a .gguf file (llama.cpp's, Ollama's) or a folder of one, a hub id "
    "(org/name), a known name (smollm2, gemma3:270m: fetched once when not installed) or demo (random weights, "
    "for tests); default smollm2"
)
_USAGE = "spindle [serve] [--model MODEL] [--port PORT] [FLAGS]   (python -m server is the same)"
_FOOTER = (
    "--help=all lists every flag; --help=GROUP one group ({}). Every flag has a SPINDLE_* variable: "
    "docs/serving.md.\nOther commands: spindle render --model M (templates and tokens only, no engine); "
    "spindle make-demo PATH (a demo checkpoint)."
)


class HelpAction(argparse._HelpAction):
    """-h / --help [GROUP]: the short form, all, or one group."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        argparse.Action.__init__(
            self,
            option_strings=option_strings,
            dest=dest,
            default=argparse.SUPPRESS,
            nargs="?",
            metavar="GROUP",
            help="this help; --help=all: every flag; --help=GROUP: one group of flags",
        )

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        which = values or "short"
        if which not in ("short", "all", *GROUPS):
            parser.error(f"--help takes all or one of {', '.join(GROUPS)}; got {which!r}")
        parser._print_message(render_help(parser, which), sys.stdout)
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a mistyped flag names the closest real one."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"spindle: {message}{self._suggestion(message)} (spindle --help lists the flags)\n")

    def _suggestion(self, message: str) -> str:
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m is None:
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for word in m[1].split():
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


def metavar(flag: str, typ: Any) -> str:
    """A short placeholder: N for counts, X for other numbers, else the flag's last word (--served-model-name NAME)."""
    if typ is int:
        return "N"
    if typ is float:
        return "X"
    return flag.rsplit("-", 1)[-1].upper()


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=32, width=min(_columns(), 110))


def _columns() -> int:
    import shutil

    return max(shutil.get_terminal_size((100, 24)).columns - 2, 72)


def make_parser(description: str) -> tuple[Parser, dict[str, argparse._ArgumentGroup]]:
    """The parser with its help action and one argument group per concern, in --help's order."""
    parser = Parser(prog="spindle", usage=_USAGE, description=description, add_help=False, formatter_class=_formatter)
    parser.add_argument("-h", "--help", action=HelpAction)
    return parser, {name: parser.add_argument_group(title) for name, title in GROUPS.items()}


def group_for(groups: dict[str, argparse._ArgumentGroup], flag: str) -> argparse._ArgumentGroup:
    return groups[GROUP_OF.get(flag, "serving")]


def render_help(parser: argparse.ArgumentParser, which: str) -> str:
    """short: the COMMON flags of every group; all: every flag; a group's name: that group's flags."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, [], [])
    formatter.add_text(parser.description)
    for group in parser._action_groups:
        name = next((n for n, title in GROUPS.items() if title == group.title), None)
        if name is None or which not in ("short", "all", name):
            continue
        shown = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        if which == "short":
            shown = [a for a in shown if set(a.option_strings) & COMMON]
        if not shown:
            continue
        formatter.start_section(group.title)
        formatter.add_arguments(shown)
        formatter.end_section()
    formatter.add_text(_FOOTER.format(", ".join(GROUPS)))
    return formatter.format_help()
