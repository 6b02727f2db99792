// The real client across a server restart: an IdempotentProducer with several requests in
// flight writes TOTAL JSON messages; tests/streams.rs kills and restarts the server when this
// prints "HALF". A reader then checks every message arrived exactly once, in order.
import { DurableStream, IdempotentProducer } from "@durable-streams/client"

const url = process.env.STREAM_URL
const total = Number(process.env.TOTAL || 2000)
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

// The producer leaves transport retries to its fetch: this one retries refused connections
// (the server is down) and 503s, and hands every other answer back unchanged.
async function retryingFetch(input, init) {
  for (let attempt = 0; ; attempt++) {
    try {
      const response = await fetch(input, init)
      if (response.status !== 503 || attempt > 200) return response
    } catch (e) {
      if (attempt > 200) throw e
    }
    await sleep(50)
  }
}

const stream = await DurableStream.create({ url, contentType: "application/json" })
let errors = 0
const producer = new IdempotentProducer(stream, "restart-producer", {
  fetch: retryingFetch,
  maxInFlight: 5,
  lingerMs: 2,
  maxBatchBytes: 512,
  onError: (e) => {
    errors++
    console.error(`producer error: ${e}`)
  },
})
for (let i = 0; i < total; i++) {
  producer.append(JSON.stringify({ i, pad: "x".repeat(40) }))
  if (i === Math.floor(total / 2)) console.log("HALF")
  if (i % 20 === 0) await sleep(2)
}
await producer.flush()
console.log("FLUSHED")

const res = await stream.stream({ live: false })
const items = await res.json()
const seen = items.map((m) => m.i)
const inOrder = seen.length === total && seen.every((v, k) => v === k)
console.log(JSON.stringify({ total, received: seen.length, inOrder, errors }))
process.exit(inOrder && errors === 0 ? 0 : 1)
