"""The decisions of role_parts (steps of role parts that a trainer completes, e.g. verl's) taken
from an agreed survey, on hand-made node scans: per-role retention (only sealed steps count; the
tracked step, the step being written and the one it continues from are never removed; a step
left without parts goes whole; a removal cut short is finished), crash debris only while the
trainer's tracker is visible, and why a step cannot be sealed. The engines' side (saves, kills,
resumes, two nodes) is tests/verl/test_verl_ckpt_roles.py."""
from __future__ import annotations

from mcore_rl.checkpoint import role_parts
from mcore_rl.checkpoint.inventory import merge_scans


def _sealed(order: int, roles=("actor", "critic"), held=("actor", "critic"), entries=None) -> dict:
    return {"marker": "ok", "order": order, "crc": f"m{order}", "roles": list(roles), "kind": "parts",
            "parts": {r: "p" for r in held}, "entries": list(entries or (*held, "COMPLETE", "data.pt"))}


def _open(held=("actor", "critic"), entries=None) -> dict:
    return {"marker": "none", "order": None, "crc": None, "parts": {r: "p" for r in held},
            "entries": list(entries or held)}


def _survey(steps: dict[int, dict], tracker: int | None, nodes: int = 1, node_steps: dict | None = None):
    scans = {}
    for n in range(nodes):
        view = {str(s): v for s, v in steps.items()}
        view.update({str(s): v for s, v in (node_steps or {}).get(n, {}).items()})
        scans[n] = {"steps": view, "links": [], "side": {},
                    "tracker": None if tracker is None or n else str(tracker).encode().hex()}
    return merge_scans("/r", scans)


def test_per_role_counts_over_sealed_steps_only():
    found = _survey({1: _sealed(1), 2: _sealed(2), 3: _sealed(3), 4: _open(), 6: _open()}, tracker=3)
    actor = role_parts.retention(found, "actor", 2, 5, 3)
    assert (actor.parts, actor.steps) == ([(1, "actor")], [])  # 2, 3 kept; 4 and 6 are not sealed: never count
    critic = role_parts.retention(found, "critic", 1, 5, 3)
    assert (critic.parts, critic.steps) == ([(1, "critic"), (2, "critic")], [])
    assert actor.debris == [4]  # no marker, below the step being written, not tracked
    gone = _survey({1: _sealed(1, held=("actor",), entries=("actor", "COMPLETE")), 2: _sealed(2)}, tracker=2)
    assert role_parts.retention(gone, "actor", 1, 3, 2).steps == [1]  # its last part: the whole step
    assert role_parts.retention(gone, "critic", None, 3, 2) == role_parts.Removals([], [], [])  # keep all


def test_tracked_written_and_continued_steps_are_never_removed():
    # a rollback: sealed 2, 4, 6, 8; the tracker names 8 (verl's resume_from_path leaves it), the run
    # resumed 4 and now writes 5: 4 is what 5 continues from and stays until 5 is sealed
    found = _survey({2: _sealed(1), 4: _sealed(2), 6: _sealed(3), 8: _sealed(4)}, tracker=8)
    assert role_parts.retention(found, "actor", 1, 5, 8).parts == [(2, "actor"), (6, "actor")]
    # the tracked step stays even when it completed before others (completion order, not number)
    found = _survey({3: _sealed(5), 7: _sealed(1), 8: _sealed(6)}, tracker=7)
    assert role_parts.retention(found, "actor", 1, 9, 7).parts == [(3, "actor")]


def test_debris_only_while_the_tracker_is_visible_and_removals_cut_short_are_finished():
    steps = {1: _open(), 2: _open()}
    assert role_parts.retention(_survey(steps, tracker=None), "actor", 1, 3, None).debris == []
    # node 1 lost the critic's record (a removal cut short) but holds its files: counted, and finished
    cut = {0: {1: _sealed(1)}, 1: {1: _sealed(1, held=("actor",), entries=("actor", "critic", "COMPLETE"))}}
    found = _survey({2: _sealed(2), 3: _sealed(3)}, tracker=3, nodes=2, node_steps=cut)
    assert role_parts.retention(found, "critic", 2, 4, 3).parts == [(1, "critic")]


def test_seal_problems_name_the_part_and_the_nodes():
    found = _survey({5: _open()}, tracker=5, nodes=2, node_steps={1: {5: _open(held=("actor",))}})
    assert role_parts.seal_problems(found, 5) == ["the critic part has no PART record on node(s) [1]"]
    found = _survey({5: _open()}, tracker=5, nodes=2, node_steps={1: {5: {**_open(), "parts": {"actor": "q",
                                                                                               "critic": "p"}}}})
    assert role_parts.seal_problems(found, 5) == ["the nodes hold different actor part records"]
    assert role_parts.seal_problems(_survey({5: _open(held=())}, tracker=5), 5) == [
        "it holds no role part with a record"]


def test_hf_export_staging_is_neither_a_part_nor_a_trainer_file_and_goes_with_its_part(tmp_path):
    """A background HF export stages its merge beside the part (``hf_export_record.staging_dir``,
    merge's own staging dirs of it beside that): sealing never records it as the trainer's, a
    save of the next role continues the step, and the part's removal takes it along."""
    import math
    import os
    import shutil

    from mcore_rl.checkpoint.hf_export_record import staging_dir
    from mcore_rl.fileio.staging import Staging

    step = tmp_path / "global_step_4"
    for role in ("actor", "critic"):
        (step / role).mkdir(parents=True)
    role_parts.write_part(str(step / "actor" / "PART"), role_parts.PartRecord(4, "actor", 1.0, {}))
    (step / "data.pt").write_bytes(b"verl")
    staged = {}
    for role in ("actor", "critic"):
        target = staging_dir(str(step / role))
        os.makedirs(target)
        (step / os.path.basename(target) / "model.safetensors").write_bytes(b"w")
        staged[role] = [os.path.basename(target), os.path.basename(Staging.create(target).path)]
    assert all(role_parts.export_staging(n, r) for r, names in staged.items() for n in names), staged
    assert not role_parts.export_staging(staged["critic"][0], "actor") and not role_parts.export_staging("actor")
    assert set(role_parts.trainer_files(str(step), ["actor", "critic"])) == {"data.pt"}
    os.remove(step / "data.pt")
    shutil.rmtree(step / "critic")
    assert role_parts.continues(str(step), "critic", -math.inf)  # the actor's export staging is ours
    role_parts.remove_part(str(step), "actor")
    assert sorted(os.listdir(step)) == sorted(staged["critic"])
