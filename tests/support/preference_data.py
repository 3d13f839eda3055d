"""Preference records for the preference tests, drawn from Hamlet: the chosen answer is the line that
follows the prompt, the rejected one the same words in reverse order (a preference a model that read
Shakespeare can learn), in TRL's standard (strings) and conversational (messages) formats; and TRL
1.16's tokenization, losses and logged metrics written with transformers and torch alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from assets.make_chat_data import speeches

from tests.support import REPO


def hamlet_lines() -> list[str]:
    return [" ".join(s[1].split()) for s in speeches(REPO / "assets/data/shakespeare/hamlet.txt") if s is not None]


def make_pairs(n: int, offset: int = 0, answer_chars: int = 60, chat: bool = False) -> list[dict]:
    """`n` records from line `offset` on: {prompt, chosen, rejected} as strings, or (chat) as
    messages, every third one a whole conversation without 'prompt'."""
    lines = hamlet_lines()
    records = []
    for i in range(offset, offset + n):
        prompt = lines[i % len(lines)][:40]
        chosen = lines[(i + 1) % len(lines)][:answer_chars]
        rejected = " ".join(reversed(chosen.split()))
        if rejected == chosen:
            rejected = chosen + " " + chosen
        if not chat:
            records.append({"prompt": prompt + "\n", "chosen": chosen, "rejected": rejected})
            continue
        question = [{"role": "user", "content": prompt}]
        chosen_turn, rejected_turn = ([{"role": "assistant", "content": text}] for text in (chosen, rejected))
        if i % 3 == 0:
            records.append({"chosen": question + chosen_turn, "rejected": question + rejected_turn})
        else:
            records.append({"prompt": question, "chosen": chosen_turn, "rejected": rejected_turn})
    return records


def trl_ids(hf, prompt, answer) -> tuple[list[int], int]:
    """TRL 1.16's tokenization of one answer, with a transformers tokenizer `hf` alone: the prompt
    (with the generation prompt) and prompt + answer tokenized whole; the answer starts where the two
    lists diverge (strings: the EOS token's text appended to an answer that lacks it). Returns the ids
    and that start."""
    if isinstance(answer, str):
        eos = "" if answer.endswith(hf.eos_token) else hf.eos_token
        prompt_ids, ids = hf(prompt)["input_ids"], hf(prompt + answer + eos)["input_ids"]
    else:
        prompt_ids = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = hf.apply_chat_template(prompt + answer, tokenize=True)
        prompt_ids, ids = (list(getattr(x, "input_ids", x)) for x in (prompt_ids, ids))
    start = next(i for i, (a, b) in enumerate(zip(ids, prompt_ids + [None] * len(ids))) if a != b)
    return ids, start


def split_record(record: dict) -> tuple:
    """(prompt, (chosen answer, rejected answer)) of a record; a whole conversation's prompt is what
    precedes its last assistant turn."""
    if "prompt" in record:
        return record["prompt"], (record["chosen"], record["rejected"])
    return record["chosen"][:-1], (record["chosen"][-1:], record["rejected"][-1:])


def trl_rows(hf, record) -> list[tuple[list[int], int]]:
    """DPOTrainer's tokenization of a record: (prompt + answer ids, where the answer starts) for chosen
    and rejected, the start being where the prompt's ids and either answer's first differ."""
    prompt, answers = split_record(record)
    if isinstance(prompt, str):
        eos = hf.eos_token
        prompt_ids = hf(prompt)["input_ids"]
        rows = [hf(prompt + (a if a.endswith(eos) else a + eos))["input_ids"] for a in answers]
    else:
        def ids(messages, **kwargs):
            return list(hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])
        prompt_ids, rows = ids(prompt, add_generation_prompt=True), [ids(prompt + a) for a in answers]

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = min(common(prompt_ids, row) for row in rows)
    return [(row, start) for row in rows]


def trl_objective(loss_type, beta, gamma, policy, reference, hf, pairs):
    """TRL's loss and logged metrics for a batch of pairs (rows chosen..., then rejected... as TRL
    concatenates them), padded on the right with an attention mask."""
    rows = [r for which in (0, 1) for pair in pairs for r in [trl_rows(hf, pair)[which]]]
    width = max(len(ids) for ids, _ in rows)
    pad = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id  # as TRL pads
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    answer = torch.tensor([[int(start <= i < len(ids)) for i in range(width)] for ids, start in rows])[:, 1:]

    def token_logps(model):
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
        return logits, torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]

    logits, per_token = token_logps(policy)
    n = len(pairs)
    sums, counts = (per_token * answer).sum(1), answer.sum(1)
    c, r, nc, nr = sums[:n], sums[n:], counts[:n], counts[n:]
    if loss_type in ("sigmoid", "ipo"):  # DPOTrainer
        ref = (token_logps(reference)[1] * answer).sum(1)
        cr, rr = c - ref[:n], r - ref[n:]
        loss = (-F.logsigmoid(beta * (cr - rr)) if loss_type == "sigmoid"
                else (cr / nc - rr / nr - 1 / (2 * beta)) ** 2).mean()
        rewards, logps = (beta * cr, beta * rr), (c, r)
    else:
        cm, rm = c / nc, r / nr
        if loss_type == "simpo":  # CPOTrainer, loss_type="simpo", cpo_alpha=0
            loss = -F.logsigmoid(beta * (cm - rm - gamma / beta)).mean()
        else:  # ORPOTrainer
            def log1mexp(x):
                return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
            log_odds = (cm - rm) - (log1mexp(cm) - log1mexp(rm))
            labels = torch.where(attention == 1, input_ids, -100)[:n, 1:]
            nll = F.cross_entropy(logits[:n].reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss = nll - (beta * F.logsigmoid(log_odds)).mean()
        rewards, logps = (beta * cm, beta * rm), (cm, rm)
    metrics = {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1], "rewards/margins": rewards[0] - rewards[1],
               "rewards/accuracies": (rewards[0] > rewards[1]).float(), "logps/chosen": logps[0],
               "logps/rejected": logps[1]}
    # a reward is β times a difference of sums of fp32 log-probabilities: its error scales with theirs
    scale = beta * (sums.abs() + (ref.abs() if loss_type in ("sigmoid", "ipo") else 0)).max().item()
    return loss.item(), {name: value.mean().item() for name, value in metrics.items()}, scale
