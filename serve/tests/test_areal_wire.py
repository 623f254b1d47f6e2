"""AReaL's wire format and semantics, mapped by our own code (serve/areal_wire.py, serve/areal.py) and
checked against AReaL 1.0.4's own (its files from the wheel: serve/tests/areal_client.py): every dtype
its tensors travel in (bf16 as the float32 bytes AReaL writes), ndarrays, nested lists and dicts both
ways; every payload that would make AReaL's reader import, unpickle or decode something refused by name
with nothing imported; sizes checked before decoding. Then the mapping: our loss on an update's fields
moved to tokens equals AReaL's ppo_critic_loss_fn on them per position; an update's rows go to the
mini-batches AReaL's ffd_allocate makes; values per position are a plain token-classification forward."""

import base64
import dataclasses
import enum
import json
import sys

import numpy
import pytest
import torch

from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.learning.loss import shift_to_tokens, value_loss
from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.serve import areal, areal_wire
from critic_adapters.serve.schema import Limits, RequestError, update_request
from critic_adapters.serve.updates import minibatch_groups
from critic_adapters.serve.tests import areal_client

AREAL = areal_client.load()


def wire(value):
    """What AReaL's client puts on the wire for `value` (serialize_value, then JSON as requests sends it)."""
    return json.loads(json.dumps(AREAL.serialize_value(value)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_every_tensor_dtype_areal_writes_decodes_to_the_same_tensor(dtype):
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(3, 5, generator=generator) * 50).to(dtype)
    decoded = areal_wire.decode(wire(tensor))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_bf16_travels_as_float32_bytes_and_decodes_exactly():
    tensor = torch.tensor([[0.5, -1.25, 3.0e-3]], dtype=torch.bfloat16)
    payload = wire(tensor)
    assert payload["dtype"] == "torch.bfloat16" and len(base64.b64decode(payload["data"])) == 3 * 4  # AReaL's form
    assert torch.equal(areal_wire.decode(payload), tensor)


def test_the_controllers_envelope_of_trajectories_decodes_key_by_key():
    trajectories = [{"input_ids": torch.tensor([[5, 6, 7, 0]], dtype=torch.int32),
                     "attention_mask": torch.tensor([[1, 1, 1, 0]], dtype=torch.bool),
                     "rewards": torch.tensor([1.0]), "note": "x", "n": 3, "none": None}
                    for _ in range(2)]
    body = {"args": wire([trajectories]), "kwargs": wire({})}
    decoded = areal_wire.decode(body)
    assert decoded["kwargs"] == {} and len(decoded["args"][0]) == 2
    for got, sent in zip(decoded["args"][0], trajectories):
        assert set(got) == set(sent)
        for key, value in sent.items():
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value


def test_ndarrays_and_dtypes_decode():
    array = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    assert torch.equal(areal_wire.decode(wire(array)), torch.from_numpy(array))
    assert areal_wire.decode(wire(numpy.array([True, False]))).dtype == torch.bool
    assert areal_wire.decode(wire(torch.bfloat16)) is torch.bfloat16


def test_what_we_write_areal_reads_back():
    values = [torch.tensor([[0.25, -1.0, 0.0]]), torch.zeros(2, 4)]
    result = json.loads(json.dumps(areal_wire.encode(values)))
    read = AREAL.deserialize_value(result)
    assert len(read) == 2 and all(torch.equal(a, b) for a, b in zip(read, values))
    assert AREAL.deserialize_value(areal_wire.encode({"n": 3, "t": torch.tensor([1, 2])}))["t"].tolist() == [1, 2]


@dataclasses.dataclass
class Meta:
    path: str


class Colour(enum.Enum):
    RED = 1


def test_payloads_that_name_code_are_refused_and_nothing_is_imported(tmp_path):
    # A module that says when it is imported, named by a dataclass payload the way AReaL writes one.
    (tmp_path / "areal_probe_module.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').write('yes')\n"
        "import dataclasses\n@dataclasses.dataclass\nclass Probe:\n    path: str = ''\n")
    payload = wire(Meta("/x"))
    assert payload["type"] == "dataclass" and payload["class_path"].endswith(".Meta")
    payload["class_path"] = "areal_probe_module.Probe"
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RequestError) as refused:
            areal_wire.decode({"args": [payload], "kwargs": {}})
        assert refused.value.status == 422 and refused.value.field == "body.args[0]"
        assert "areal_probe_module.Probe" in refused.value.rule and "never imports" in refused.value.rule
        assert not (tmp_path / "imported").exists() and "areal_probe_module" not in sys.modules
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(RequestError, match="enum payload names a module"):
        areal_wire.decode(wire(Colour.RED))
    for tag, said in (("tokenizer", "tokenizer payload"), ("processor", "processor payload"),
                      ("ray_object_ref", "Ray object reference"), ("pil_image", "image payload")):
        with pytest.raises(RequestError, match=said):
            areal_wire.decode({"type": tag, "data": "AAAA"})


def test_an_rtensor_reference_is_refused_saying_how_to_send_tensors():
    reference = {"type": "dataclass", "class_path": areal_wire.RTENSOR,
                 "data": {"shard": {"type": "dataclass", "class_path": "areal.infra.rpc.rtensor.TensorShardInfo",
                                    "data": {"shard_id": "3f2a", "node_addr": "10.0.0.5:31234"}},
                          "data": wire(torch.empty(1, 8, device="meta"))}}
    with pytest.raises(RequestError) as refused:
        areal_wire.decode([{"input_ids": reference}])
    assert refused.value.field == "body[0].input_ids" and "shard 3f2a" in refused.value.rule
    assert "send the tensors inline" in refused.value.rule


def test_sizes_are_checked_before_decoding():
    good = wire(torch.arange(6, dtype=torch.int64).reshape(2, 3))
    for corrupt, why in [
        (dict(good, shape=[2, 4]), "64 base64 characters"),  # data for 6 int64, shape of 8
        (dict(good, data=good["data"][:-4]), "takes 48 bytes"),
        (dict(good, dtype="torch.int32"), "takes 24 bytes"),
        (dict(good, data="!" * len(good["data"])), "not base64"),
        (dict(good, data=None), "meta tensor"),
        (dict(good, shape=[-1, 3]), "non-negative"),
        (dict(good, shape=[1 << 20, 1 << 20]), "more than"),
        (dict(good, dtype="torch.complex64"), "one of torch.float32"),
        (dict(good, extra=1), "unknown key"),
    ]:
        with pytest.raises(RequestError, match=why) as refused:
            areal_wire.decode({"args": [corrupt]})
        assert refused.value.status == 422 and refused.value.field.startswith("body.args[0]")


def _update_body(rng, lengths, width):
    """An update call of AReaL's trainer: rows right-padded to `width`, loss_mask rolled (never on a row's
    last position), values and returns per position."""
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.bool)
    loss_mask = torch.tensor([[int(2 <= t < n - 1) for t in range(width)] for n in lengths], dtype=torch.int32)
    trajectory = {"input_ids": torch.randint(3, 50, (len(lengths), width), generator=rng) * mask,
                  "attention_mask": mask, "loss_mask": loss_mask,
                  "values": torch.randn(len(lengths), width, generator=rng),
                  "returns": torch.randn(len(lengths), width, generator=rng), "rewards": torch.ones(len(lengths))}
    return {"args": wire([[trajectory]]), "kwargs": {}}, trajectory


def test_our_loss_on_the_mapped_update_is_areals_loss_on_its_positions():
    rng = torch.Generator().manual_seed(3)
    body, sent = _update_body(rng, [9, 5, 12, 7], width=12)
    request = areal.update_request(body, Limits(vocab_size=100, max_positions=None, areal_minibatches=2))
    new_values = torch.randn(4, 12, generator=rng)  # what the critic would output now, per position
    eps = 0.2
    theirs, _ = AREAL.ppo_critic_loss_fn(new_values, sent["values"], sent["returns"], eps,
                                         loss_mask=sent["loss_mask"].bool())
    # As the engines take it: the value of token t is the output at t - 1 (shift_to_tokens), against the
    # request's token-aligned fields.
    ours, _ = value_loss(shift_to_tokens(new_values), request.old_values, request.returns,
                         request.response_mask, clip_range=eps, agg_mode="token-mean")
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    assert request.minibatches == 2 and request.request_id.startswith("areal-")
    assert areal.update_request(body, Limits(100, None, areal_minibatches=2)).request_id == request.request_id
    # The journal keeps it as our own update body; a restart reads it back as the same update, its steps too.
    again = update_request(json.loads(json.dumps(request.to_json())), Limits(vocab_size=100, max_positions=None))
    assert (again.request_id, again.digest, again.minibatches) == (request.request_id, request.digest, 2)


def test_an_update_that_would_lose_a_position_or_has_too_few_rows_is_refused():
    rng = torch.Generator().manual_seed(4)
    body, sent = _update_body(rng, [6, 4], width=6)
    with pytest.raises(RequestError, match="2 rows for 4 mini-batches"):
        areal.update_request(body, Limits(vocab_size=100, max_positions=None))
    last = dict(sent, loss_mask=sent["loss_mask"].clone())
    last["loss_mask"][1, 3] = 1  # row 1's last token
    with pytest.raises(RequestError, match="row 1 marks its last position"):
        areal.update_request({"args": wire([[last]]), "kwargs": {}}, Limits(100, None, areal_minibatches=1))


@pytest.mark.parametrize("seed", range(4))
def test_an_updates_rows_go_to_the_minibatches_areal_makes(seed):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (int(torch.randint(4, 40, (1,), generator=rng)),), generator=rng).tolist()
    for groups in (1, 2, 4):
        theirs = sorted(sorted(int(i) for i in group) for group in AREAL.ffd_allocate(lengths, int(1e12), groups))
        assert minibatch_groups(lengths, groups) == theirs, (lengths, groups)


def test_values_per_position_are_a_plain_token_classification_forward(tmp_path):
    path, reference = build.token_classification(str(tmp_path))
    model, _ = load_critic(path)
    ids = torch.randint(3, build.VOCAB, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        ours = compute_values(model, ids, mask)  # what the engines answer: per position, unshifted
        plain = reference(ids, mask)
    assert float((ours - plain).abs()[mask.bool()].max()) <= 1e-5
    # The token-aligned view that our updates use is the same numbers one to the right.
    assert torch.equal(areal.positions_to_tokens(ours)[:, 1:], ours[:, :-1])


if __name__ == "__main__":
    run_pytest(__file__)
