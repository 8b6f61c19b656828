"""Multi-turn, tool-using rollout (spec.rollout.mode multiTurn; docs/multi-turn.md): tool calls,
tools, the chat template's tool turns, routing over engines and the asyncio driver."""
