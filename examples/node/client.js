#!/usr/bin/env node
// Streams one generation from a hyspec server with @grpc/grpc-js, loading the same .proto
// the server is built from (proto/hyspec/v1/hyspec.proto in the checkout).
//
//   npm install            (or `make node-deps` at the repository root)
//   node client.js [--address 127.0.0.1:50051] [--max-tokens 32] [--json] "The capital of France is"
//
// The text streams to stdout as it arrives; the final response (token ids, finish reason,
// speculation stats) is printed after it as one JSON line when --json is given, otherwise a
// one-line summary goes to stderr. Exit code 0 on completion, 1 on any error.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = process.env.HYSPEC_PROTO_DIR || path.join(__dirname, "..", "..", "proto");

function parseArgs(argv) {
  const opts = { address: "127.0.0.1:50051", maxTokens: 32, json: false, prompt: "Hello", id: "node-1" };
  const rest = [];
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--address") opts.address = argv[++i];
    else if (a === "--max-tokens") opts.maxTokens = parseInt(argv[++i], 10);
    else if (a === "--request-id") opts.id = argv[++i];
    else if (a === "--json") opts.json = true;
    else rest.push(a);
  }
  if (rest.length) opts.prompt = rest.join(" ");
  return opts;
}

function loadService() {
  const definition = protoLoader.loadSync("hyspec/v1/hyspec.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (request_id, token_ids, ...)
    longs: Number,
    enums: String, // FINISH_REASON_LENGTH rather than 2
    defaults: true,
    oneofs: true, // sets `kind` to the name of the oneof member present
  });
  return grpc.loadPackageDefinition(definition).hyspec.v1.Generation;
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  const Generation = loadService();
  const client = new Generation(opts.address, grpc.credentials.createInsecure());
  const call = client.Generate();
  let finished = false;

  call.on("data", (msg) => {
    if (msg.request_id !== opts.id) return;
    if (msg.kind === "chunk") {
      process.stdout.write(msg.chunk.text);
    } else if (msg.kind === "complete") {
      finished = true;
      const c = msg.complete;
      if (opts.json) {
        process.stdout.write("\n" + JSON.stringify(c) + "\n");
      } else {
        const s = c.stats;
        process.stderr.write(`\n[${c.finish_reason}] ${s.completion_tokens} tokens, ` +
          `${s.tokens_per_second.toFixed(1)} tok/s, accepted ${s.accepted}/${s.drafted}\n`);
      }
    } else if (msg.kind === "error") {
      finished = true;
      process.stderr.write(`error ${msg.error.code}: ${msg.error.message}\n`);
      process.exitCode = 1;
    }
  });
  call.on("error", (err) => {
    process.stderr.write(`stream failed: ${err.code} ${err.details || err.message}\n`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    if (!finished) {
      process.stderr.write("the stream ended without a result\n");
      process.exitCode = 1;
    }
    client.close();
  });

  // One request, then half-close: the server finishes it and ends the stream with OK.
  call.write({ request: { request_id: opts.id, text: opts.prompt, max_tokens: opts.maxTokens } });
  call.end();
}

main();
