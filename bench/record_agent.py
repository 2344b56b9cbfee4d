"""Record coding-agent sessions for `mlxspec bench --workloads agent`.

A real agent client (the OpenAI Agents SDK, its chat-completions model) works on a scratch
copy of third-party source files through function tools that really act on them (`list_dir`,
`read_file`, `write_file`, `replace_in_file`), against a running `mlxspec serve`. Every
request body is kept as the client sent it (an httpx event hook), with the server's answer and
its kind: `edit` (a call of write_file or replace_in_file), `answer` (the call of `finish`,
whose argument is the agent's final answer) or `tool_call` (any other call). The agent asks
for a call every turn (`tool_choice: "required"`, so the server holds the answer to the
model's call syntax: the coder models otherwise write calls as JSON in a code block) and ends
with `finish`. One JSON file per session goes to mlxspec/bench/agent_sessions/.

    mlxspec serve -m qwen2.5-coder-1.5b --port 8795 &
    python bench/record_agent.py --url http://127.0.0.1:8795/v1

The files copied come from installed packages with permissive licenses (attrs: MIT, h11: MIT,
Jinja2: BSD-3-Clause, click: BSD-3-Clause); each session names its package, version and
license.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sysconfig
import tempfile
from importlib.metadata import version
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "mlxspec" / "bench" / "agent_sessions"
EDIT_TOOLS = ("write_file", "replace_in_file")

INSTRUCTIONS = """You are a coding agent working in a Python repository on the user's machine.
You can list directories, read files and change them with the tools given; you cannot run code.
Always read a file with read_file before changing it. To change a file, prefer replace_in_file:
`old` must be copied exactly from the file (whole lines, with their indentation) and `new` is
the text that replaces it. Use write_file only to create a file or rewrite a short one
entirely. Make one change at a time. When the task is done, call finish with a short summary
of what you changed."""

# (session name, distribution, package folder, license, files copied, the user's task)
TASKS = [
    ("attrs-rename", "attrs", "attr", "MIT", ["filters.py", "setters.py"],
     "Read attr/filters.py, then rename the loop variable `cls` in `_split_what` to `item` "
     "(all three generator expressions). Keep the behaviour the same."),
    ("jinja2-rename", "jinja2", "jinja2", "BSD-3-Clause", ["visitor.py", "meta.py"],
     "Read jinja2/visitor.py, then rename the local variable `f` in `NodeVisitor.visit` to "
     "`visitor`. Keep the behaviour the same."),
    ("h11-util", "h11", "h11", "MIT", ["_util.py", "_receivebuffer.py"],
     "Read h11/_util.py: its `bytesify` says \"expected bytes-like object, not int\" when given "
     "an int. Change that message to \"expected bytes, bytearray, memoryview or str, not "
     "int\"."),
    ("click-globals", "click", "click", "BSD-3-Clause", ["globals.py", "_textwrap.py"],
     "Read click/globals.py, then add a function `has_context()` after `get_current_context` that "
     "returns True when a context is pushed and False otherwise, with a docstring."),
]


def kind_of(message: dict) -> str:
    names = [c.get("function", {}).get("name") for c in message.get("tool_calls") or []]
    if any(n in EDIT_TOOLS for n in names):
        return "edit"
    return "tool_call" if names and names != ["finish"] else "answer"


def make_tools(root: Path):
    from agents import function_tool

    def inside(path: str) -> Path:
        p = (root / path).resolve()
        if root.resolve() not in (p, *p.parents):
            raise ValueError(f"{path} is outside the repository")
        return p

    @function_tool
    def list_dir(path: str = ".") -> str:
        """List the files and folders in a directory of the repository."""
        p = inside(path)
        return "\n".join(sorted(f.name + ("/" if f.is_dir() else "") for f in p.iterdir()))

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the repository and return its text."""
        return inside(path).read_text()

    @function_tool
    def write_file(path: str, content: str) -> str:
        """Write `content` to a file of the repository, replacing what it held."""
        p = inside(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        return f"wrote {len(content.splitlines())} lines to {path}"

    @function_tool
    def replace_in_file(path: str, old: str, new: str) -> str:
        """Replace the exact text `old` in a file of the repository by `new`."""
        p = inside(path)
        text = p.read_text()
        n = text.count(old)
        if n != 1:
            return (f"error: `old` occurs {n} times in {path}; copy it exactly from the file, "
                    f"whole lines, so that it occurs once. The file holds:\n{text}")
        p.write_text(text.replace(old, new))
        return f"replaced {len(old.splitlines())} lines with {len(new.splitlines())} in {path}"

    @function_tool
    def finish(summary: str) -> str:
        """Say that the task is done, with a short summary of what changed."""
        return summary

    return [list_dir, read_file, write_file, replace_in_file, finish]


async def record(url: str, model: str, task, scratch: Path, max_tokens: int,
                 max_turns: int) -> dict:
    import httpx
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, StopAtTools
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    name, dist, package, license_, files, prompt = task
    root = scratch / name
    src = Path(sysconfig.get_paths()["purelib"]) / package
    (root / package).mkdir(parents=True)
    for f in files:
        shutil.copy(src / f, root / package / f)
    turns = []

    async def on_request(request):
        if request.url.path.endswith("/chat/completions"):
            turns.append({"request": json.loads(request.content)})

    async def on_response(response):
        if response.request.url.path.endswith("/chat/completions"):
            await response.aread()
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}: {response.text}")
            message = response.json()["choices"][0]["message"]
            turns[-1]["answer"] = {k: message.get(k) for k in ("content", "tool_calls")}
            turns[-1]["kind"] = kind_of(message)

    async with httpx.AsyncClient(event_hooks={"request": [on_request],
                                              "response": [on_response]},
                                 timeout=900) as http:
        client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, http_client=http)
        agent = Agent(name="coder", instructions=INSTRUCTIONS, tools=make_tools(root),
                      model=OpenAIChatCompletionsModel(model, client),
                      model_settings=ModelSettings(temperature=0, max_tokens=max_tokens,
                                                   tool_choice="required"),
                      tool_use_behavior=StopAtTools(stop_at_tool_names=["finish"]),
                      reset_tool_choice=False)
        try:
            result = await Runner.run(agent, prompt, max_turns=max_turns)
            final = result.final_output
        except MaxTurnsExceeded:
            final = None
    changed = sorted(f for f in files
                     if (root / package / f).read_text() != (src / f).read_text())
    return {"name": name, "task": prompt, "model": model,
            "source": {"distribution": dist, "version": version(dist), "license": license_,
                       "files": [f"{package}/{f}" for f in files]},
            "files_changed": [f"{package}/{f}" for f in changed], "final_output": final,
            "turns": turns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8795/v1")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", default=None, help="comma-separated session names")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-turns", type=int, default=5)
    args = ap.parse_args()
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory() as scratch:
        for task in TASKS:
            if only and task[0] not in only:
                continue
            session = asyncio.run(record(args.url, args.model, task, Path(scratch),
                                         args.max_tokens, args.max_turns))
            path = args.out / f"{task[0]}.json"
            path.write_text(json.dumps(session, indent=1, ensure_ascii=False) + "\n")
            kinds = [t.get("kind", "?") for t in session["turns"]]
            print(f"{path.name}: {len(kinds)} turns ({', '.join(kinds)}), "
                  f"changed {session['files_changed'] or 'nothing'}", flush=True)


if __name__ == "__main__":
    main()
