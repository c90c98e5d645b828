"""A scripted ``generate_fn`` for harness tests (importable as ``replies``): fixed replies, no model."""

from types import SimpleNamespace


def replay(renderer, turns_per_episode):
    """A generate_fn replaying fixed replies: episode i's k-th call gets turns_per_episode[i][k]."""
    queues = [[renderer.encode(t) + [renderer.eot_id] for t in turns] for turns in turns_per_episode]

    def generate(prompts, max_new_tokens, idx):
        outs = [queues[i].pop(0) for i in idx]
        return [SimpleNamespace(output_ids=o, logprobs=[-0.5] * len(o), stop_reason="stop") for o in outs]

    return generate
