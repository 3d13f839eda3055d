"""models/common/head.py and models/transformers/head.py: the final hidden states and a head that projects
rows of them, handed to a loss in place of the logits (on-policy distillation), equal the model's own
logits: weft's decoders with and without gradient, transformers' Llama and a Gemma 2 that soft-caps
(its forward computing the last position's logits only), and a transformers student's gradient; a family
whose logits are something else gets them whole."""

from __future__ import annotations

import pytest
import torch

from weft.models import flavors, spec_for_flavor
from weft.models.common.head import forward_head
from weft.parallelisms.materialize import materialize

transformers = pytest.importorskip("transformers")
from weft.models.transformers.head import forward_head as hf_forward_head  # noqa: E402


def weft_model(flavor: str = "debugmodel_qwen3"):
    with torch.device("meta"):
        model = spec_for_flavor(flavor).build(flavors()[flavor])
    materialize(model, torch.device("cpu"), seed=0)
    return model


def rows_in_chunks(seen: list[int]):
    """A `use` projecting the hidden states 5 rows at a time, as the divergence does."""

    def use(hidden, project):
        rows = hidden.reshape(-1, hidden.shape[-1])
        chunks = [project(rows[i:i + 5]) for i in range(0, rows.shape[0], 5)]
        seen.extend(c.shape[0] for c in chunks)
        return torch.cat(chunks)

    return use


def test_a_weft_decoder_s_rows_project_to_its_logits_with_and_without_gradient():
    model = weft_model()
    tokens = torch.randint(0, model.args.vocab_size, (2, 9))
    logits = model(tokens).reshape(18, -1)
    output_inputs = []
    hook = model.output.register_forward_hook(lambda m, args, out: output_inputs.append(args[0].shape[0]))
    seen = []
    got = forward_head(model, tokens, None, None, rows_in_chunks(seen))
    hook.remove()
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)  # BLAS blocks 5 rows otherwise than 18
    assert seen == output_inputs == [5, 5, 5, 3]  # the output module saw chunks, never the batch
    got.square().sum().backward()  # the gradient reaches the body through the chunks
    assert model.layers["0"].attention.wq.weight.grad.abs().sum() > 0
    with torch.no_grad():  # a frozen teacher: the head may be called after the forward
        hidden, project = forward_head(model, tokens, None, None, lambda h, p: (h, p))
        torch.testing.assert_close(project(hidden.reshape(18, -1)), logits, rtol=1e-6, atol=1e-6)


def hf_model(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(**LLAMA),
    # soft-capping at 0.5 bends every logit of this model (they reach about 1): a head without it fails
    transformers.Gemma2Config(**LLAMA, head_dim=8, final_logit_softcapping=0.5, sliding_window=4),
], ids=["llama", "gemma2_softcap"])
def test_a_transformers_teacher_s_hidden_states_and_head_give_its_logits(config):
    model = hf_model(config)
    tokens = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        logits = model(tokens).logits.reshape(18, -1)
        heads = []
        hook = model.lm_head.register_forward_hook(lambda m, args, out: heads.append(args[0].shape[1]))
        hidden, project = hf_forward_head(model, tokens, None, None, lambda h, p: (h, p))
        hook.remove()
        assert model.weft_head_repeats_logits
        assert heads[-1] == 1  # the forward computed the last position's logits only
        torch.testing.assert_close(project(hidden.reshape(18, -1)), logits, rtol=1e-5, atol=1e-6)
    if isinstance(config, transformers.Gemma2Config):
        assert logits.abs().max() < 0.5 and (logits.abs().max() > 0.3)  # the cap acts on these logits


def test_a_transformers_student_s_head_carries_the_gradient_its_logits_would():
    """With gradient the head is the student's own lm_head (then the soft-cap): the loss and every gradient
    equal those of the same loss on its whole logits."""
    config = transformers.Gemma2Config(**LLAMA, head_dim=8, final_logit_softcapping=0.5, sliding_window=4)
    tokens = torch.randint(0, 96, (2, 9))
    whole, chunked = hf_model(config), hf_model(config)
    loss = (whole(tokens).logits.reshape(18, -1).log_softmax(-1)[:, 3] * torch.arange(18)).sum()
    loss.backward()
    heads = []
    hook = chunked.lm_head.register_forward_hook(lambda m, args, out: heads.append(args[0].shape[-2]))
    got = hf_forward_head(chunked, tokens, None, None, rows_in_chunks([]))
    hook.remove()
    assert heads[-5:] == [1, 5, 5, 5, 3]  # the forward's last position, then the chunks
    mine = (got.log_softmax(-1)[:, 3] * torch.arange(18)).sum()
    mine.backward()
    torch.testing.assert_close(mine, loss)
    for (name, theirs), ours in zip(whole.named_parameters(), chunked.parameters()):
        # summed in another order (the tied embedding's gradient reaches 233): fp32 rounding of its largest
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6 * theirs.grad.abs().max().item(),
                                   msg=name)


def test_logits_a_head_cannot_repeat_come_whole():
    model = hf_model(transformers.LlamaConfig(**LLAMA))
    tokens = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        logits = model(tokens).logits

    def doubled(module, args, kwargs, output):  # a family whose forward changes its logits after lm_head
        output.logits = output.logits * 2
        return output

    hook = model.register_forward_hook(doubled, with_kwargs=True)
    got, project = hf_forward_head(model, tokens, None, None, lambda h, p: (h, p))
    hook.remove()
    assert model.weft_head_repeats_logits is False
    assert got.requires_grad and project(got) is got  # the logits themselves, rows as they are
    torch.testing.assert_close(got.detach(), logits * 2)
