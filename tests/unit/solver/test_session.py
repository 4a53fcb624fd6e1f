"""A SolverSession (caches kept across calls) decides exactly like plain solve calls, over
micro-batches with releases and outside changes in between."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched_scheduler.domain.solver import (
    ShapeDistribution,
    SolverSession,
    release,
    solve,
)

from .conftest import batches, clusters

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", ["best-fit", "fgd", "gpusched"])
@SETTINGS
@given(state=clusters(max_nodes=5), steps=st.lists(batches(max_units=6), min_size=1,
                                                   max_size=5),
       lookahead=st.booleans(), release_mask=st.lists(st.booleans(), min_size=5, max_size=5),
       max_slots=st.sampled_from([None, 2]))
def test_session_matches_plain_solve(policy, state, steps, lookahead, release_mask,
                                     max_slots):
    shapes = ShapeDistribution.from_batch(steps[0], coverage=1.0)
    session = SolverSession(policy, shapes, max_slots=max_slots)
    plain_state = session_state = state
    for i, batch in enumerate(steps):
        a = session.solve(session_state, batch, lookahead=lookahead)
        b = solve(plain_state, batch, policy, shapes=shapes, lookahead=lookahead)
        np.testing.assert_array_equal(a.node, b.node)
        np.testing.assert_array_equal(a.gpus, b.gpus)
        np.testing.assert_array_equal(a.reason, b.reason)
        session_state, plain_state = a.state, b.state
        if release_mask[i]:  # the batch finishes before the next one arrives
            session_state = release(session_state, batch, a.node, a.gpus)
            plain_state = release(plain_state, batch, b.node, b.gpus)
        if i == 2:  # an outside change: a GPU goes unhealthy
            session_state = session_state.copy()
            session_state.gpu_healthy[: 1] = False
            plain_state = plain_state.copy()
            plain_state.gpu_healthy[: 1] = False
