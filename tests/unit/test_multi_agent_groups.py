"""A learner group of a multi-agent run, in one process: the ranks step the same policy at the
same time (``StagedByPolicy``), and what a follower counts of each policy and of self-play
reaches rank 0 (``RankCounts`` -> ``RunCounters.add_rank_report``)."""

from __future__ import annotations

import msgpack
import torch

from apex.config import load_dict
from apex.envs.policy_map import multi_agent_spec
from apex.learner.follower import RankCounts
from apex.learner.ingest import RunCounters
from apex.learner.pace import StagedByPolicy
from apex.multiagent.actor import MultiAgentActor
from apex.multiagent.learner import MultiPolicyLearner
from apex.transport.sessions import RejectCounter


class ListPipeline:
    """The two calls ``StagedByPolicy`` makes of a pipeline, over a list."""

    def __init__(self, staged: list) -> None:
        self.staged, self.submitted = list(staged), []

    def take(self):
        return self.staged.pop(0) if self.staged else None

    def submit(self, pending) -> None:
        self.submitted.append(pending)


def no_group(parameters, bad, has_batch=True):
    """An all-reduce over a group of one: a rank without a batch gets a zero gradient."""
    for p in parameters:
        if not has_batch or p.grad is None:
            p.grad = torch.zeros_like(p)
    return torch.zeros((), dtype=torch.bool)


def speaker_listener_learner() -> tuple[MultiPolicyLearner, MultiAgentActor]:
    cfg = load_dict(
        {
            "env": {"id": "tests.multiagent_envs:speaker_listener"},
            "multi_agent": {"mapping": "per_agent"},
            "apex_dqn": {"batch_size": 8, "replay": {"min_size": 8}},
            "actor": {"num_envs": 2},
        }
    )
    spec = multi_agent_spec(cfg)
    learner = MultiPolicyLearner(cfg, spec, torch.device("cpu"))
    setup = {"num_envs": 2, "seed": 0, **learner.actor_setup(0, 2)}
    return learner, MultiAgentActor(cfg, setup, seed=0, spec=spec)


def test_the_ranks_step_each_policy_as_agreed_and_one_without_a_batch_steps_without():
    learner, actor = speaker_listener_learner()
    learner.all_reduce = no_group
    assert all(core.all_reduce is no_group for core in learner.cores.values())
    while learner.cores["speaker"].metrics()["replay_size"] < 8:  # data for the speaker alone
        batch, _ = actor.act()
        policy = actor.batch_info([])["policy"] if batch is not None else None
        if policy == "speaker":
            arrays, _ = learner.cores[policy].schema.validate(batch, learner.policy_limits(policy, 2))
            learner.cores[policy].insert_many([arrays])
    actor.close()
    staged = learner.prepare(timeout=1.0, most=2)
    assert [learner.policy_of(s) for s in staged] == ["speaker", "speaker"]

    pipeline = ListPipeline(staged)
    by_policy = StagedByPolicy(pipeline, learner)  # type: ignore[arg-type]
    assert by_policy.counts() == [2, 0]  # speaker, listener: the learner's order
    # The group agreed on 3 speaker steps (another rank had 3) and 2 listener ones.
    assert by_policy.train((3, 2)) == 3
    assert [p.context[0] for p in pipeline.submitted] == ["speaker"] * 3 + ["listener"] * 2
    learner.finish(pipeline.submitted)  # steps without a batch have no priorities to write back
    assert {name: core.updates for name, core in learner.cores.items()} == {"speaker": 3, "listener": 2}
    assert by_policy.counts() == [0, 0]


def test_a_followers_counts_of_each_policy_and_its_self_play_matches_reach_rank_0():
    follower = RunCounters(("speaker", "listener"))
    counts = RankCounts(follower, RejectCounter())
    with follower.lock:
        follower.env_steps += 10
        follower.stats.add(1.0, True)
        follower.policy_stats["speaker"].add(0.5, False)
        follower.policy_stats["listener"].add(1.5, True)
        follower.matches.extend([(3, 1), (4, -1)])
    report = msgpack.unpackb(counts.take({"replay_size": 0, "steps_without_batch": 0}), strict_map_key=False)

    rank_0 = RunCounters(("speaker", "listener"))
    with rank_0.lock:
        rank_0.add_rank_report(report)
    assert rank_0.env_steps == 10 and rank_0.stats.episodes == 1
    assert rank_0.policy_stats["speaker"].episodes == rank_0.policy_stats["listener"].episodes == 1
    assert rank_0.policy_stats["listener"].eval_returns[-1] == 1.5
    assert rank_0.matches == [(3, 1), (4, -1)]
    # sent once: the next report is empty
    again = msgpack.unpackb(counts.take({"replay_size": 0, "steps_without_batch": 0}), strict_map_key=False)
    assert again["policy_episodes"] == {"speaker": [], "listener": []} and again["matches"] == []
    assert follower.matches == []
