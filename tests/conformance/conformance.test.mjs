// The protocol's own conformance suite, run against the sluice server that tests/streams.rs
// starts. Subscriptions are opt-in (SUBSCRIPTIONS=1).
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

runConformanceTests({
  baseUrl: process.env.CONFORMANCE_TEST_URL,
  longPollTimeoutMs: Number(process.env.LONG_POLL_TIMEOUT_MS || 20000),
  subscriptions: process.env.SUBSCRIPTIONS === "1",
})
