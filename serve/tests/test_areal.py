"""AReaL drives the service: its own PPOCriticControllerV2 and serializer (areal 1.0.4's files, loaded by
serve/tests/areal_client.py) against `python -m critic_adapters.serve` at 2 ranks (fsdp), serving a
transformers token-classification critic.

One server, in order: health; compute_values on two padded batches equal to a plain
AutoModelForTokenClassification forward at every position (AReaL's alignment); six updates, each built as
AReaL's trainer builds it (the values it got, returns, loss_mask rolled left by one), lower the squared
error on loss_mask by 30% or more; the version counts them and set_version moves it forward only;
tokens (none, wrong, the user's on an admin route); a dataclass payload refused without importing the
module it names; a corrupt tensor refused, the server answering on.
"""

import json

import pytest
import torch

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.serve.tests import areal_client
from critic_adapters.serve.tests.service import Server, call, write_tokens

AREAL = areal_client.load()


def trajectory(rng: torch.Generator, rows: int, prompt: int, response: int, width: int | None = None) -> dict:
    """One of AReaL's trajectories as its RLVR workflow makes it ([rows, T] int32 ids, bool mask, int32
    loss_mask over the response, float32 rewards [rows]), right-padded to `width`."""
    length = prompt + response
    width = width or length
    ids = torch.randint(3, build.VOCAB, (rows, width), generator=rng, dtype=torch.int32)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, :length] = True
    loss_mask = torch.zeros(rows, width, dtype=torch.int32)
    loss_mask[:, prompt:length] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask,
            "rewards": torch.ones(rows), "versions": torch.zeros(rows, width, dtype=torch.int32)}


def for_update(trajectory: dict, values: torch.Tensor, target: float) -> dict:
    """What AReaL's compute_advantages hands the critic: loss_mask rolled left by one (position t counts
    when token t + 1 was generated), returns per position, the values it got."""
    loss_mask = torch.roll(trajectory["loss_mask"], -1, dims=1)
    returns = torch.full(values.shape, target) * loss_mask
    return {**trajectory, "loss_mask": loss_mask, "values": values, "returns": returns,
            "advantages": returns - values, "logprobs": torch.zeros(values.shape)}


def masked_error(values: torch.Tensor, update: dict) -> float:
    mask = update["loss_mask"].bool()
    return float(((values - update["returns"]) ** 2)[mask].mean())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("areal")
    user, admin = write_tokens(tmp)
    path, reference = build.token_classification(str(tmp))
    probe = tmp / "probe"
    probe.mkdir()
    (probe / "areal_probe_payload.py").write_text(f"open({str(tmp / 'imported')!r}, 'w').write('yes')\n")
    server = Server(tmp, f"engine.model.path={path}",
                    env={"PYTHONPATH": f"{probe}:{__import__('os').environ.get('PYTHONPATH', '')}"})
    try:
        yield server, areal_client.critic_client(server.url, user), user, admin, reference, tmp
    finally:
        server.kill()


def test_areal_drives_the_service(served):
    server, client, user, admin, reference, tmp = served
    url = server.url
    assert call(url, "/health")[0] == 200

    # -- compute_values: per position, as AReaL aligns them (no shift), padding 0 -----------------------------
    rng = torch.Generator().manual_seed(1)
    batches = [[trajectory(rng, 1, 3, 9), trajectory(rng, 2, 5, 4, width=12), trajectory(rng, 1, 2, 20)],
               [trajectory(rng, 3, 4, 6), trajectory(rng, 1, 6, 1)]]
    for batch in batches:
        answer = client.compute_values(batch)
        assert isinstance(answer, list) and len(answer) == len(batch)
        for got, sent in zip(answer, batch):
            assert got.shape == sent["input_ids"].shape and got.dtype == torch.float32
            with torch.no_grad():
                expected = reference(sent["input_ids"].long(), sent["attention_mask"].long())
            mask = sent["attention_mask"]
            assert float((got - expected).abs()[mask].max()) <= 2e-4
            assert not got[~mask].any()  # padding positions are 0.0, as AReaL's own

    # -- six updates, as AReaL's trainer sends them: the error on loss_mask falls --------------------------------
    train = [trajectory(rng, 1, 4, 8) for _ in range(4)]
    errors = []
    for _ in range(6):
        values = client.compute_values(train)
        updates = [for_update(t, v, target=0.8) for t, v in zip(train, values)]
        errors.append(sum(masked_error(v, u) for v, u in zip(values, updates)) / len(updates))
        client.ppo_update(updates)
    after = client.compute_values(train)
    final = sum(masked_error(v, for_update(t, v, 0.8)) for t, v in zip(train, after)) / len(train)
    assert final <= 0.7 * errors[0], (errors, final)

    # -- versions: one per update, set_version forward only, the same as /v1/version ---------------------------
    # (areal 1.0.4's controller answers get_version from its own memory; GET /get_version is the gateway's route)
    assert client._gateway_get_result("/get_version") == 6
    client.set_version(7)
    assert client._gateway_get_result("/get_version") == 7 and call(url, "/v1/version", token=user)[1]["version"] == 7
    with pytest.raises(RuntimeError, match="409"):
        client.set_version(3)

    # -- tokens --------------------------------------------------------------------------------------------
    body = {"args": AREAL.serialize_value([batches[1]]), "kwargs": {}}
    assert call(url, "/ppo/critic/compute_values", body)[0] == 401
    assert call(url, "/ppo/critic/compute_values", body, token="not-" + user)[0] == 401
    assert call(url, "/offload", {}, token=user)[0] == 403  # AReaL's gateway sends its admin key here

    # -- a payload naming a module: refused, the module never imported -----------------------------------------
    payload = {"args": [[{"input_ids": {"type": "dataclass", "class_path": "areal_probe_payload.Rows", "data": {}},
                          "attention_mask": AREAL.serialize_value(torch.ones(1, 3, dtype=torch.bool))}]],
               "kwargs": {}}
    status, refused, _ = call(url, "/ppo/critic/compute_values", payload, token=user)
    assert 400 <= status < 500 and "areal_probe_payload.Rows" in refused["error"]["rule"], refused
    assert not (tmp / "imported").exists()

    # -- a corrupt tensor: refused, and the server answers on ---------------------------------------------------
    corrupt = json.loads(json.dumps(body))
    tensor = corrupt["args"][0][0]["input_ids"]
    tensor["shape"] = [tensor["shape"][0], tensor["shape"][1] + 1]
    status, refused, _ = call(url, "/ppo/critic/compute_values", corrupt, token=user)
    assert 400 <= status < 500 and refused["error"]["field"].endswith("input_ids.data"), refused
    assert call(url, "/health")[0] == 200 and len(client.compute_values(batches[1])) == 2


if __name__ == "__main__":
    run_pytest(__file__)
