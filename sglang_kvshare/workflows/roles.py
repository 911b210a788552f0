"""Agent roles per dataset: three task agents followed by a FinalRefer reflection agent.

Roles follow KVCOMM (appendix B.1 of the KVCMAS paper), whose prompts come from AgentPrune:
MMLU (and GPQA): Knowledgeable Expert, Wiki Searcher, Critic; GSM8K: Math Solver, Mathematical
Analyst, Programming Expert; HumanEval: Project Manager, Algorithm Designer, Programming Expert.
Prompts are shortened for SmolLM2-135M (8K context).

A role's text is PF (agent-specific) content: its system prompt, its glue before each output of
another agent it reads, and its closing instruction. Shared PH content (question, agent outputs)
never comes from a role.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Mapping, Optional, Tuple

FINAL_AGENT = "final_refer"


@dataclass(frozen=True)
class ChatFormat:
    """Chat markup placed in PF segments around the trajectory; PH text is never wrapped.

    A trajectory renders as ``system_open + system_prompt + user_open + q + (glue + out)* +
    closing_instruction + assistant_open``; generation starts after ``assistant_open``.
    """

    name: str
    system_open: str
    user_open: str
    assistant_open: str


CHATML = ChatFormat(
    name="chatml",  # SmolLM2-Instruct's template
    system_open="<|im_start|>system\n",
    user_open="<|im_end|>\n<|im_start|>user\n",
    assistant_open="<|im_end|>\n<|im_start|>assistant\n",
)
PLAIN = ChatFormat(name="plain", system_open="", user_open="\n\n", assistant_open="\nAnswer:\n")
CHAT_FORMATS: Dict[str, ChatFormat] = {f.name: f for f in (CHATML, PLAIN)}


@dataclass(frozen=True)
class Role:
    """One agent.

    name: agent id sent as ``kvshare.agent``; its output is the shared slot ``out:<name>``.
    title: how other agents' glue prompts refer to this agent.
    glue_template: PF text placed before each output this agent reads; ``{source}`` is replaced by
        the source agent's title (``"You"`` for the agent's own earlier output).
    closing_instruction: PF text after the last shared segment (empty for none).
    lora_path: adapter name sent as ``lora_path`` (None: base model).
    """

    name: str
    title: str
    system_prompt: str
    glue_template: str = "\n\n{source} wrote:\n"
    closing_instruction: str = ""
    lora_path: Optional[str] = None

    def glue(self, source_title: str) -> str:
        return self.glue_template.format(source=source_title)


@dataclass(frozen=True)
class RoleSet:
    """The agents of one dataset's workflow: ``task_roles`` in workflow order, then ``final_role``,
    whose output is scored."""

    dataset: str
    task_roles: Tuple[Role, ...]
    final_role: Role

    @property
    def roles(self) -> Tuple[Role, ...]:
        return self.task_roles + (self.final_role,)

    def by_name(self) -> Dict[str, Role]:
        return {r.name: r for r in self.roles}

    def __post_init__(self):
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names):
            raise ValueError(f"role names must be unique, got {names}")


_MC_RULES = (
    " Only one of the options is correct. Reply in under 100 words."
    " The first line of your reply must contain only the letter of your answer."
)
_MC_CLOSING = "\n\nGive the letter of the correct option on the first line."

_MMLU_ROLES = (
    Role(
        name="knowledgeable_expert",
        title="Knowledgeable Expert",
        system_prompt=(
            "You are a knowledgeable expert in question answering. Name at most three key "
            "entities of the question between two '@', for example @Shakespeare@, and say what "
            "you know about them." + _MC_RULES
        ),
        closing_instruction=_MC_CLOSING,
    ),
    Role(
        name="wiki_searcher",
        title="Wiki Searcher",
        system_prompt=(
            "You are a Wiki searcher. Recall encyclopedia facts about the key entities of the "
            "question, use them step by step to answer, and point out issues in other agents' "
            "analysis." + _MC_RULES
        ),
        closing_instruction=_MC_CLOSING,
    ),
    Role(
        name="critic",
        title="Critic",
        glue_template="\n\n{source} wrote (check it for errors):\n",
        system_prompt=(
            "You are an excellent critic. Point out potential issues in other agents' analysis "
            "point by point." + _MC_RULES
        ),
        closing_instruction=_MC_CLOSING,
    ),
)
_MC_FINAL = Role(
    name=FINAL_AGENT,
    title="FinalRefer",
    glue_template="\n\n{source} answered:\n",
    system_prompt=(
        "You are the top decision-maker. You analyse and summarise other agents' opinions, find "
        "errors and give the final answer to a multiple-choice question."
    ),
    closing_instruction="\n\nReply with only the letter of the correct option.",
)

_MATH_LAST_LINE = (
    " The last line of your output contains only the final result without any units, for example: The answer is 140"
)
_GSM8K_ROLES = (
    Role(
        name="math_solver",
        title="Math Solver",
        system_prompt=(
            "You are a math expert. Solve the math problem step by step, using hints from other "
            "agents if given." + _MATH_LAST_LINE
        ),
    ),
    Role(
        name="mathematical_analyst",
        title="Mathematical Analyst",
        system_prompt=(
            "You are a mathematical analyst. First analyse the problem-solving process step by "
            "step with variables written as letters, then substitute the values and compute the "
            "result." + _MATH_LAST_LINE
        ),
    ),
    Role(
        name="programming_expert",
        title="Programming Expert",
        system_prompt=(
            "You are a programming expert. Solve the math problem with a Python function that "
            "takes no arguments and returns the final result; the last line of code is "
            "`answer = fun()`. Reply with one ```python code block only."
        ),
    ),
)
_GSM8K_FINAL = Role(
    name=FINAL_AGENT,
    title="FinalRefer",
    glue_template="\n\n{source} answered:\n",
    system_prompt=(
        "You are the top decision-maker. Given a math problem and the analysis and code of other "
        "agents, find the most reliable answer and give brief reasons." + _MATH_LAST_LINE
    ),
    closing_instruction="\n\nEnd with: The answer is <number>",
)

_CONCISE = " Be concise: at most fifty words."
_CODE_ONLY = (
    " Write the full implementation, restating the function signature, in one ```python code "
    "block. Do not change the function name or argument types. Write nothing outside the block."
)
_HUMANEVAL_ROLES = (
    Role(
        name="project_manager",
        title="Project Manager",
        system_prompt=(
            "You are a project manager. Given a function signature and docstring, outline the "
            "structure of the code: the functions (maybe only one) and any helpers needed, "
            "without over-engineering." + _CONCISE
        ),
    ),
    Role(
        name="algorithm_designer",
        title="Algorithm Designer",
        system_prompt=(
            "You are an algorithm designer. Given a function signature and docstring, specify the "
            "algorithm step by step; give pseudocode when the logic is complex." + _CONCISE
        ),
    ),
    Role(
        name="programming_expert",
        title="Programming Expert",
        system_prompt=(
            "You are a programming expert. Given a function signature and docstring and other "
            "agents' plans, which may be wrong, implement the function." + _CODE_ONLY
        ),
    ),
)
_HUMANEVAL_FINAL = Role(
    name=FINAL_AGENT,
    title="FinalRefer",
    glue_template="\n\n{source} wrote:\n",
    system_prompt=(
        "You are the top decision-maker and answer only with Python code. Given a function "
        "signature and docstring and other agents' designs and code, choose or fix the most "
        "reliable implementation." + _CODE_ONLY
    ),
    closing_instruction="\n\nWrite the complete function in one ```python code block.",
)

_ROLE_SETS: Dict[str, RoleSet] = {
    "mmlu": RoleSet("mmlu", _MMLU_ROLES, _MC_FINAL),
    "gpqa": RoleSet("gpqa", _MMLU_ROLES, _MC_FINAL),
    "gsm8k": RoleSet("gsm8k", _GSM8K_ROLES, _GSM8K_FINAL),
    "humaneval": RoleSet("humaneval", _HUMANEVAL_ROLES, _HUMANEVAL_FINAL),
}


def get_roles(dataset: str) -> RoleSet:
    """Prompt-specialised agents of ``dataset`` (GPQA reuses the MMLU roles)."""
    if dataset not in _ROLE_SETS:
        raise ValueError(f"no roles for dataset {dataset!r}; choose from {sorted(_ROLE_SETS)}")
    return _ROLE_SETS[dataset]


_AO = CHATML.assistant_open
_LORA_TURNS = (
    ("solver", "Solver", "\n\nSolve the problem step by step and end with '#### <answer>'."),
    ("critic", "Critic", "<|im_end|>\n<|im_start|>user\nCheck the proposed solution above and give a verdict."),
    (
        "final",
        "Final",
        "<|im_end|>\n<|im_start|>user\nRead the solution and the check, then state the final "
        "answer as '#### <answer>'.",
    ),
)
LORA_SYSTEM_PROMPT = "You are one agent of a team that solves grade-school math problems."


def lora_conversation_roles(dataset: str = "gsm8k") -> RoleSet:
    """Agents that differ ONLY by LoRA adapter (``solver``, ``critic``, ``final``: the adapters in
    ``adapters/``), taking turns in one growing chat (CHATML): every prompt extends the previous
    agent's prompt and output, so the whole trajectory is a common token prefix (PReCache's
    setting). Each role's instruction is its closing text; it is also the glue in front of its
    output when a later agent reads it (``title`` = instruction + assistant header)."""
    roles = [
        Role(
            name=name,
            title=instr + _AO,
            system_prompt=LORA_SYSTEM_PROMPT,
            glue_template="{source}",
            closing_instruction=instr,
            lora_path=name,
        )
        for name, _, instr in _LORA_TURNS
    ]
    return RoleSet(dataset=dataset, task_roles=tuple(roles[:2]), final_role=roles[2])


def with_lora_adapters(
    role_set: RoleSet, adapters: Mapping[str, str], shared_system_prompt: Optional[str] = None
) -> RoleSet:
    """LoRA-specialised agents: role ``name`` uses adapter ``adapters[name]`` (roles not named keep
    the base model). With ``shared_system_prompt`` every role's system prompt is replaced by it, so
    agents differ only by adapter (and glue/closing text)."""
    unknown = set(adapters) - set(role_set.by_name())
    if unknown:
        raise ValueError(f"adapters name unknown roles {sorted(unknown)}")

    def adapt(role: Role) -> Role:
        fields = {"lora_path": adapters.get(role.name, role.lora_path)}
        if shared_system_prompt is not None:
            fields["system_prompt"] = shared_system_prompt
        return replace(role, **fields)

    return RoleSet(
        dataset=role_set.dataset,
        task_roles=tuple(adapt(r) for r in role_set.task_roles),
        final_role=adapt(role_set.final_role),
    )
