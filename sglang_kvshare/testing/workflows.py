"""Building annotated requests for a small agent workflow (shared question + earlier outputs), the
agents of the serving benchmark's workflows (``make_roles``), and reading the server's state back."""

from __future__ import annotations

from dataclasses import replace

from sglang_kvshare.workflows import Role, lora_conversation_roles

QUESTION = (
    "Question: "
    + " ".join(f"Fact {i}: box {i} holds {3 * i} red apples and {i + 2} green pears." for i in range(24))
    + " How many red apples are in box 5?"
)

SYSTEM = {
    "solver": "You are a careful solver. Think step by step.",
    "critic": "You are a strict critic who checks every claim of the solver.",
    "final": "You read the analyses and give the final answer only.",
}


SPECIALTIES = (
    "domain expert who recalls the relevant facts",
    "analyst who reasons step by step",
    "critic who checks the other agents' claims",
    "programmer who verifies the numbers with code",
    "summariser who condenses the discussion",
    "sceptic who looks for missing cases",
    "planner who splits the task into steps",
)


def make_roles(n_agents: int, kind: str = "prompt", prefix: str = "") -> tuple[list[Role], Role]:
    """``n_agents - 1`` task agents ``agent0..`` (distinct system prompts) and the final agent;
    ``kind="lora"``: the three adapter agents of ``lora_conversation_roles`` (one growing chat);
    ``kind="lora-random"``: the shipped roles' turns in a cycle, with adapters ``a0, a1, ...``.
    ``prefix`` renames the prompt agents (other roles: ``<prefix>agent0``, ``<prefix>final``)."""
    if kind == "lora":
        roles = lora_conversation_roles()
        if n_agents != len(roles.roles):
            raise ValueError(f"--agent-kind lora has {len(roles.roles)} agents (the shipped adapters)")
        return list(roles.task_roles), roles.final_role
    if kind == "lora-random":
        shipped = lora_conversation_roles().roles
        roles = [replace(shipped[i % len(shipped)], name=f"a{i}", lora_path=f"a{i}") for i in range(n_agents)]
        return roles[:-1], roles[-1]
    if n_agents < 2:
        raise ValueError("a workflow needs at least 2 agents (one task agent and the final agent)")
    shift = 3 if prefix else 0  # other roles: other specialties too
    task = [
        Role(
            name=f"{prefix}agent{i}",
            title=f"Agent {i}",
            system_prompt=f"You are agent {i}, a {SPECIALTIES[(i + shift) % len(SPECIALTIES)]}. Answer briefly.",
        )
        for i in range(n_agents - 1)
    ]
    final = Role(
        name=prefix + "final",
        title="Final",
        glue_template="\n\n{source} answered:\n",
        system_prompt=(
            "You are the moderator. Weigh the answers above."
            if prefix
            else "You are the final decision-maker. Read the other agents and answer."
        ),
        closing_instruction="\n\nGive the final answer.",
    )
    return task, final


def segments(
    agent: str, outputs: dict[str, str], system: str | None = None, question: str = QUESTION, slot: str = "q"
) -> list[dict]:
    segs = [
        {"text": f"<|im_start|>system\n{system or SYSTEM[agent]}<|im_end|>\n<|im_start|>user\n", "shared": False},
        {"text": question, "shared": True, "slot": slot},
    ]
    for prev, text in outputs.items():
        segs.append({"text": f"\n{prev} wrote: ", "shared": False})
        segs.append({"text": text, "shared": True, "slot": f"out:{prev}"})
    segs.append({"text": "<|im_end|>\n<|im_start|>assistant\n", "shared": False})
    return segs


def payload(workflow: str, agent: str, method: str, segs: list[dict], max_new_tokens: int = 8, **extra) -> dict:
    return {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "kvshare": {"workflow": workflow, "agent": agent, "method": method, "segments": segs, **extra},
    }


def run_workflow(server, workflow: str, method: str, agents=("solver", "critic", "final"), max_new_tokens: int = 8):
    """Run agents in sequence, each seeing the question and all earlier outputs; returns responses."""
    outputs: dict[str, str] = {}
    results = []
    for agent in agents:
        r = server.generate(payload(workflow, agent, method, segments(agent, outputs), max_new_tokens))
        assert r.status_code == 200, r.text
        out = r.json()
        results.append(out)
        if out["text"]:
            outputs[agent] = out["text"]
    return results


def private_tokens(meta: dict) -> int:
    return sum(s["tokens"] for s in meta["segments"] if not s["shared"])


def flush_cache(server) -> None:
    """Empty the server's radix tree (SGLang's ``/flush_cache``; it waits up to 60 s for
    requests of other tests still in flight)."""
    import requests

    flushed = requests.post(server.url + "/flush_cache", params={"timeout": 60}, timeout=120)
    assert flushed.status_code == 200, flushed.text


def settle(server, timeout: float = 120.0) -> dict:
    """Wait until the server has recorded every dense-fallback observation (they are factorised
    beside the scheduler); returns its ``kvshare`` internal state."""
    import time

    import requests

    deadline = time.time() + timeout
    while True:
        states = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"]
        kv = states[0]["kvshare"]
        if kv["pending_observations"] == 0 or time.time() > deadline:
            assert kv["pending_observations"] == 0, f"observations still pending after {timeout}s: {kv}"
            return kv
        time.sleep(0.2)


def scrape_metrics(server) -> dict[tuple, float]:
    """``kvshare_*`` samples of ``/metrics``: (name, sorted labels) -> value."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("kvshare_")
        for s in fam.samples
    }


def grew(before: dict, after: dict, name: str, **labels) -> float:
    """How much a sample of two ``scrape_metrics`` results grew."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)
