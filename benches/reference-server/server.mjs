// Starts the protocol's reference server: `node server.mjs PORT [DATA_DIR]`. With DATA_DIR it
// runs its durable file-backed store (fdatasync per append, coalesced); without, in memory.
import { DurableStreamTestServer } from "@durable-streams/server"

const port = Number(process.argv[2])
const dataDir = process.argv[3]
const server = new DurableStreamTestServer({
  port,
  host: "127.0.0.1",
  dataDir: dataDir || undefined,
  compression: false,
})
console.log(`READY ${await server.start()}`)
