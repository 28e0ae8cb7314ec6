#!/usr/bin/env node
// A minimal Node.js client of Tandem: loads protos/ directly (no generated code) with
// @grpc/proto-loader and streams a chat answer to stdout with @grpc/grpc-js.
//
//   node chat.js "What is the capital of France?"
//   node chat.js --address localhost:50051 --max-tokens 64 --temperature 0 --system "Be brief." "Hi!"
//   node chat.js --tls-ca ca.pem --address tandem.example:443 "Hi!"
//   node chat.js --tls-ca ca.crt --tls-server-name tandem-frontend --address localhost:50051 "Hi!"
//   node chat.js --json-schema ../../docs/examples/person.schema.json "Describe a person as JSON."
//   node chat.js --choice yes --choice no "Is water wet?"
//   node chat.js --tools ../../docs/examples/tools.json --tool-choice required "Weather in Paris?"
//   node chat.js admin lora load sql /adapters/sql     # LoRA adapters: load, list, pin, unload (admin.js)
'use strict';

const { adminMain } = require('./admin.js');
const { bearer, connect, fail, loadService, readText, statusName, tokenFrom } = require('./connection.js');

const DEFAULT_MAX_TOKENS = 128;

function usage(exitCode) {
  const text = `usage: node chat.js [options] MESSAGE
       node chat.js admin lora load NAME PATH | list | pin NAME | unload NAME  (see: node chat.js admin --help)

Stream the assistant's answer to MESSAGE from a Tandem frontend (tandem.v1.GenerationService/Chat).

options:
  --address HOST:PORT   the frontend (default: localhost:50051)
  --system TEXT         a system message before MESSAGE
  --max-tokens N        most tokens to generate; an N the context has no room for
                        after the prompt is refused unless --clamp-max-tokens
                        (default: 128, fewer where the context has less room)
  --clamp-max-tokens    cut --max-tokens to the room the context has left
  --temperature T       0 = greedy (default: the server's, 1.0)
  --seed N              seeded sampling
  --ignore-eos          keep going past end-of-sequence
  --no-speculative      no speculative decoding for this request (the answer is the same)
  --json-schema FILE    the answer is JSON valid under this JSON Schema file
  --json-object         the answer is a JSON object
  --regex R             the whole answer matches this regular expression
  --choice TEXT         the answer is one of these; repeatable
  --grammar FILE        the answer parses under this Lark grammar file
  --whitespace-flexible JSON with free whitespace (default: compact)
  --tools FILE          a JSON list of tools the model may call ({name, description,
                        parameters}); its calls print as {"tool_call": ...} lines
  --tool-choice C       auto (default), none, required, or a tool's name
  --lora NAME           answer with this loaded LoRA adapter (docs/lora.md); NOT_FOUND
                        when no engine has it
  --timeout S           deadline in seconds (default: 120)
  --tls-ca PEM          use TLS, verifying the server with this CA
  --tls-server-name NAME
                        the name the server's certificate must carry, when it is
                        not the host in --address (turns TLS on; system CAs
                        unless --tls-ca)
  --token-file PATH     send 'authorization: Bearer <token>' (default: $TANDEM_API_TOKEN)
  -h, --help            this text
`;
  (exitCode ? process.stderr : process.stdout).write(text);
  process.exit(exitCode);
}

function parseArgs(argv) {
  const args = { address: 'localhost:50051', timeout: 120, messages: [] };
  const value = (i, flag) => {
    if (i >= argv.length) fail(`${flag} needs a value`);
    return argv[i];
  };
  const number = (text, flag) => {
    const n = Number(text);
    if (!Number.isFinite(n)) fail(`${flag} expects a number, got ${JSON.stringify(text)}`);
    return n;
  };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    switch (flag) {
      case '-h': case '--help': usage(0); break;
      case '--address': args.address = value(++i, flag); break;
      case '--system': args.system = value(++i, flag); break;
      case '--max-tokens': args.maxTokens = number(value(++i, flag), flag); break;
      case '--clamp-max-tokens': args.clampMaxTokens = true; break;
      case '--temperature': args.temperature = number(value(++i, flag), flag); break;
      case '--seed': args.seed = number(value(++i, flag), flag); break;
      case '--ignore-eos': args.ignoreEos = true; break;
      case '--no-speculative': args.speculative = false; break;
      case '--json-schema': constrain(args, 'json_schema', readText(value(++i, flag), flag)); break;
      case '--json-object': constrain(args, 'json_object', true); break;
      case '--regex': constrain(args, 'regex', value(++i, flag)); break;
      case '--choice': constrain(args, 'choice', { options: [...(args.choice ? args.choice.options : []), value(++i, flag)] }); break;
      case '--grammar': constrain(args, 'grammar', readText(value(++i, flag), flag)); break;
      case '--whitespace-flexible': args.whitespaceFlexible = true; break;
      case '--tools': args.tools = readJson(value(++i, flag), flag); break;
      case '--tool-choice': args.toolChoice = value(++i, flag); break;
      case '--lora': args.lora = value(++i, flag); break;
      case '--timeout': args.timeout = number(value(++i, flag), flag); break;
      case '--tls-ca': args.tlsCa = readText(value(++i, flag), flag); break;
      case '--tls-server-name': args.tlsServerName = value(++i, flag); break;
      case '--token-file': args.tokenFile = readText(value(++i, flag), flag); break;
      default:
        if (flag.startsWith('--')) fail(`unknown flag ${flag} (see --help)`);
        args.messages.push(flag);
    }
  }
  if (args.messages.length !== 1) usage(2);
  if (args.toolChoice !== undefined && args.tools === undefined) fail('--tool-choice needs --tools');
  return args;
}

// tandem.v1.StructuredOutput's oneof `constraint`: one kind per request (--choice may repeat).
function constrain(args, kind, value) {
  if (args.constraint && args.constraint !== kind) fail(`give at most one of --json-schema, --json-object, --regex, --choice, --grammar`);
  args.constraint = kind;
  args[kind] = value;
}

function readJson(file, flag) {
  try {
    return JSON.parse(readText(file, flag));
  } catch (error) {
    return fail(`${flag}: ${file} is not JSON (${error.message})`);
  }
}

// tandem.v1.Tool from {name, description, parameters} (or OpenAI's {type: 'function', function: {...}}).
function toolsToProto(tools) {
  if (!Array.isArray(tools)) fail('--tools: the file must hold a JSON list of tools');
  return tools.map((tool) => {
    const spec = tool.function || tool;
    const parameters = spec.parameters === undefined ? '' : spec.parameters;
    return { name: spec.name, description: spec.description || '',
             parameters_json: typeof parameters === 'string' ? parameters : JSON.stringify(parameters) };
  });
}

// A call from a completion's last message, as the Python client's ToolCall: `arguments` is the JSON object
// its arguments_json holds, or null when max_tokens cut the call (`complete` false; the unfinished text stays
// in `arguments_json`, and a later request's history refuses it).
function readToolCall(call) {
  const argumentsJson = call.arguments_json || '';
  let parsed = null;
  try {
    parsed = JSON.parse(argumentsJson);
  } catch (error) {
    parsed = null;  // unfinished JSON: a cut call
  }
  const whole = parsed !== null && typeof parsed === 'object' && !Array.isArray(parsed);
  return { id: call.id || '', index: call.index || 0, name: call.name || '', arguments_json: argumentsJson,
           arguments: whole ? parsed : null, complete: whole };
}

// FINISH_REASON_LENGTH -> "length", as the Python client and CLI name finish reasons.
function finishName(reason) {
  return reason ? reason.replace(/^FINISH_REASON_/, '').toLowerCase() : null;
}

function toolChoiceToProto(choice) {
  const modes = { auto: 'TOOL_CHOICE_MODE_AUTO', none: 'TOOL_CHOICE_MODE_NONE', required: 'TOOL_CHOICE_MODE_REQUIRED' };
  return modes[choice] ? { mode: modes[choice] } : { function_name: choice };
}

function main() {
  const argv = process.argv.slice(2);
  if (argv[0] === 'admin') return adminMain(argv.slice(1));
  const args = parseArgs(argv);
  const client = connect(loadService('generation.proto', 'GenerationService'), args.address, args);

  const messages = [];
  if (args.system) messages.push({ role: 'system', content: args.system });
  messages.push({ role: 'user', content: args.messages[0] });
  // Every sampling scalar is proto3 `optional`: send only what was asked for.
  const sampling = { max_tokens: args.maxTokens ?? DEFAULT_MAX_TOKENS, output_kind: 'OUTPUT_KIND_DELTA' };
  // A default nobody asked for is cut to the context's room rather than failing the request.
  if (args.clampMaxTokens || args.maxTokens === undefined) sampling.clamp_max_tokens = true;
  if (args.temperature !== undefined) sampling.temperature = args.temperature;
  if (args.seed !== undefined) sampling.seed = String(args.seed);
  if (args.ignoreEos) sampling.ignore_eos = true;
  if (args.speculative === false) sampling.speculative = false;
  if (args.constraint) {
    sampling.structured = { [args.constraint]: args[args.constraint], whitespace_flexible: !!args.whitespaceFlexible };
  }

  const metadata = bearer(tokenFrom(args.tokenFile, ['TANDEM_API_TOKEN']));

  const deadline = new Date(Date.now() + args.timeout * 1000);
  const request = { messages, sampling_params: sampling };
  if (args.tools) request.tools = toolsToProto(args.tools);
  if (args.toolChoice) request.tool_choice = toolChoiceToProto(args.toolChoice);
  if (args.lora) request.lora_name = args.lora;
  const call = client.Chat(request, metadata, { deadline });
  let answered = false;
  const toolCalls = [];
  let finishReason = null;
  call.on('data', (response) => {
    for (const chunk of response.completions || []) {
      if (chunk.text) {  // unset (empty) text is absent with defaults: false
        process.stdout.write(chunk.text);
        answered = true;
      }
      // Deltas stream each call (id and name first, then argument fragments); the last message has them whole.
      if (chunk.tool_calls && chunk.tool_calls.length) toolCalls.splice(0, toolCalls.length, ...chunk.tool_calls);
      finishReason = finishName(chunk.finish_reason) || finishReason;
    }
  });
  call.on('error', (error) => {
    process.stderr.write(`${answered ? '\n' : ''}tandem-node: ${statusName(error.code)}: ${error.details}\n`);
    process.exitCode = 1;
    client.close();
  });
  call.on('end', () => {  // grpc-js ends the stream after an error too
    if (!process.exitCode) process.stdout.write('\n');
    for (const c of toolCalls.map(readToolCall)) {
      if (c.complete) {
        process.stdout.write(JSON.stringify({ tool_call: { id: c.id, name: c.name, arguments: c.arguments } }) + '\n');
      } else {  // cut by max_tokens: a model's output, shown as it came (as tandem chat shows it), not an error
        const cut = { id: c.id, name: c.name, finish_reason: finishReason, arguments_json: c.arguments_json };
        process.stdout.write(JSON.stringify({ cut_tool_call: cut }) + '\n');
        process.stderr.write(`(tool call ${c.id} (${c.name}) was cut, finish reason ${finishReason}: its arguments `
                             + 'are unfinished; a larger --max-tokens lets calls finish)\n');
      }
    }
    client.close();
  });
}

if (require.main === module) main();

module.exports = { readToolCall };
