// A MineDraft client built from the .proto files alone (no generated code): @grpc/grpc-js and @grpc/proto-loader.
//
//   npm ci && node generate.js localhost:50051 '{"prompt": "def fib(n):", "params": {"max_tokens": 16}}'
//
// It checks the server's grpc.health.v1 health, reads GetServerInfo, streams one Generate call whose request is
// the JSON given (proto field names), and prints one JSON object: {health, server_info, token_ids, text,
// finish_reason, usage}. A call that fails prints {"error": {code, name, details}} and exits with 3.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = process.env.MINEDRAFT_PROTOS || path.join(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync(["minedraft/v1/generation.proto", "grpc/health/v1/health.proto"], {
  includeDirs: [PROTOS],
  keepCase: true, // field names as in the .proto files
  longs: String, // uint64 seeds and the like as strings, never rounded
  enums: String,
});
const loaded = grpc.loadPackageDefinition(definition);

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + 30000 }, (error, reply) => (error ? reject(error) : resolve(reply)));
  });
}

function generate(client, request) {
  return new Promise((resolve, reject) => {
    const answer = { token_ids: [], text: "", finish_reason: null, usage: null };
    const call = client.Generate(request, { deadline: Date.now() + 120000 });
    call.on("data", (message) => {
      answer.token_ids.push(...message.token_ids);
      answer.text += message.text;
      if (message.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
        answer.finish_reason = message.finish_reason;
        answer.usage = message.usage;
      }
    });
    call.on("error", reject);
    call.on("end", () => resolve(answer));
  });
}

async function main() {
  const [address, requestJson] = process.argv.slice(2);
  if (!address || !requestJson) {
    console.error("usage: node generate.js ADDRESS REQUEST_JSON");
    process.exit(2);
  }
  const credentials = grpc.credentials.createInsecure();
  const health = new loaded.grpc.health.v1.Health(address, credentials);
  const service = new loaded.minedraft.v1.GenerationService(address, credentials);
  try {
    const status = await unary(health, "Check", { service: "" });
    const info = await unary(service, "GetServerInfo", {});
    const answer = await generate(service, JSON.parse(requestJson));
    console.log(JSON.stringify({ health: status.status, server_info: info, ...answer }));
  } catch (error) {
    const name = Object.keys(grpc.status).find((key) => grpc.status[key] === error.code);
    console.log(JSON.stringify({ error: { code: error.code, name, details: error.details } }));
    process.exitCode = 3;
  } finally {
    health.close();
    service.close();
  }
}

main();
