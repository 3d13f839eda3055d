"""generate.py's greedy decoding of a Hugging Face folder against transformers' generate on the model
that wrote it, for the tests of each family."""

from pathlib import Path

import torch

from weft.components.data import Tokenizer
from weft.components.hf import model_args_from_hf_folder
from weft.generate import main
from weft.generation import SamplingParams, generate

from tests.support import ASSETS

TOKENIZER = ASSETS / "tokenizer" / "shakespeare.model"


def assert_greedy_decoding_equals_transformers(reference, folder: Path, family: str, tokens: int, distinct: int,
                                               capsys) -> None:
    """`generate.py --hf folder --temperature 0` (and the engine on its `load_model`, a `family` model)
    gives the `tokens` tokens transformers' generate(do_sample=False) gives from `reference`, more
    than `distinct` of them different."""
    from weft.generate import load_model
    from weft.models import spec_for_model

    tokenizer = Tokenizer(TOKENIZER)
    prompt = tokenizer.encode("ROMEO:", bos=True, eos=False)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=tokens,
                                 eos_token_id=tokenizer.eos_id, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) == tokens and len(set(theirs)) > distinct  # no early EOS, not one repeated token

    model = load_model(model_args_from_hf_folder(folder), hf=str(folder), checkpoint=None,
                       device=torch.device("cpu"), dtype=torch.float32)
    assert spec_for_model(model).name == family
    greedy = SamplingParams(max_completion_length=tokens, temperature=0)
    assert generate(model, [prompt], greedy, stop_token_ids=[tokenizer.eos_id])[0][0].token_ids == theirs
    assert main(["--hf", str(folder), "--tokenizer", str(TOKENIZER), "--prompt", "ROMEO:",
                 "--max-new-tokens", str(tokens), "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(prompt + theirs) + "\n"
