// LoRA adapters over tandem.v1.AdminService (docs/lora.md): the Python client's load_lora, list_loras,
// pin_lora and unload_lora as promises, and `node chat.js admin lora ...`, the form of `tandem admin lora`.
//
//   const { AdminClient } = require('./admin.js');
//   const admin = new AdminClient('localhost:50051', { token: process.env.TANDEM_ADMIN_TOKEN });
//   await admin.loadLora('sql', '/adapters/sql');  // [{name, path, rank, alpha, target_modules, pinned, location, engine}]
//   await admin.listLoras();                       // every adapter of every engine, one entry per engine
//   await admin.pinLora('sql');                    // kept in every engine's host memory
//   await admin.unloadLora('sql');                 // the engines it left
//   admin.close();
//
// A refused call rejects with grpc-js's error: `.code` (a grpc.status) and `.details`, the server's message.
'use strict';

const { bearer, connect, fail, loadService, readText, statusName, tokenFrom } = require('./connection.js');

const DEFAULT_TIMEOUT_S = 120;
const LORA_STEPS = ['load', 'unload', 'list', 'pin'];

class AdminClient {
  // options: tlsCa (PEM text), tlsServerName, token (the admin token, or the API token when the server
  // has no --admin-token-file), timeout (seconds per call, default 120).
  constructor(address = 'localhost:50051', options = {}) {
    this.client = connect(loadService('admin.proto', 'AdminService', { defaults: true }), address, options);
    this.metadata = bearer(options.token);
    this.timeout = options.timeout ?? DEFAULT_TIMEOUT_S;
  }

  // Load the PEFT adapter folder `path` (on the engines' machines) into every engine as `name`.
  async loadLora(name, path) {
    return adapters(await this.call('LoadLoraAdapter', { lora_name: name, lora_path: path }));
  }

  // Unload an adapter everywhere; the engines it left. Refused (FAILED_PRECONDITION) while requests use it.
  async unloadLora(name) {
    return (await this.call('UnloadLoraAdapter', { lora_name: name })).engines;
  }

  async listLoras() {
    return adapters(await this.call('ListLoraAdapters', {}));
  }

  // Keep an adapter in every engine's host memory (never pushed out by others).
  async pinLora(name) {
    return adapters(await this.call('PinLoraAdapter', { lora_name: name }));
  }

  close() {
    this.client.close();
  }

  call(method, request) {
    const deadline = new Date(Date.now() + this.timeout * 1000);
    return new Promise((resolve, reject) => {
      this.client[method](request, this.metadata, { deadline }, (error, response) => (error ? reject(error) : resolve(response)));
    });
  }
}

// tandem.v1.LoraAdapter as plain objects, the fields in the Python client's order.
function adapters(response) {
  return response.adapters.map((a) => ({
    name: a.name, path: a.path, rank: a.rank, alpha: a.alpha, target_modules: a.target_modules,
    pinned: a.pinned, location: a.location, engine: a.engine,
  }));
}

function usage(exitCode) {
  const text = `usage: node chat.js admin lora load NAME PATH [options]
       node chat.js admin lora list [options]
       node chat.js admin lora pin NAME [options]
       node chat.js admin lora unload NAME [options]

LoRA adapters in every engine behind a Tandem frontend (tandem.v1.AdminService, docs/lora.md), as
\`tandem admin lora\`. load NAME PATH: read the PEFT adapter folder PATH (on the engines' machines) as NAME;
list; pin NAME (kept in the engines' host memory); unload NAME (refused while requests use it).
load, list and pin print one line per adapter and engine: name, rank, modules, where its weights are,
pinned or not, the engine, the folder.

options:
  --json                print the adapters as JSON (load, list, pin)
  --address HOST:PORT   the frontend (default: localhost:50051)
  --timeout S           deadline in seconds (default: 120)
  --tls-ca PEM          use TLS, verifying the server with this CA
  --tls-server-name NAME
                        the name the server's certificate must carry (turns TLS on)
  --token-file PATH     send 'authorization: Bearer <token>' (default: $TANDEM_ADMIN_TOKEN,
                        else $TANDEM_API_TOKEN)
  -h, --help            this text
`;
  (exitCode ? process.stderr : process.stdout).write(text);
  process.exit(exitCode);
}

function parseArgs(argv) {
  const args = { address: 'localhost:50051', timeout: DEFAULT_TIMEOUT_S, words: [] };
  const value = (i, flag) => {
    if (i >= argv.length) fail(`${flag} needs a value`);
    return argv[i];
  };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    switch (flag) {
      case '-h': case '--help': usage(0); break;
      case '--json': args.json = true; break;
      case '--address': args.address = value(++i, flag); break;
      case '--timeout': {
        args.timeout = Number(value(++i, flag));
        if (!Number.isFinite(args.timeout)) fail(`--timeout expects a number, got ${JSON.stringify(argv[i])}`);
        break;
      }
      case '--tls-ca': args.tlsCa = readText(value(++i, flag), flag); break;
      case '--tls-server-name': args.tlsServerName = value(++i, flag); break;
      case '--token-file': args.tokenFile = readText(value(++i, flag), flag); break;
      default:
        if (flag.startsWith('--')) fail(`unknown flag ${flag} (see node chat.js admin --help)`);
        args.words.push(flag);
    }
  }
  const [action, step, name, path, ...rest] = args.words;
  if (action !== 'lora') fail(`admin ${action === undefined ? 'needs an action' : `has no action ${action}`}: lora (see node chat.js admin --help)`);
  if (!LORA_STEPS.includes(step)) fail(`admin lora needs one of ${LORA_STEPS.join(', ')}${step === undefined ? '' : `, got ${step}`}`);
  if (step !== 'list' && !name) fail(`lora ${step} needs the adapter's NAME`);
  if (step === 'load' && !path) fail("lora load needs NAME and PATH, the PEFT adapter folder on the engines' machines");
  const extra = step === 'load' ? rest : (step === 'list' ? [name, path, ...rest] : [path, ...rest]);
  if (extra.some((word) => word !== undefined)) fail(`lora ${step}: unexpected ${extra.filter((w) => w !== undefined).join(' ')}`);
  return { ...args, step, name, path };
}

// `node chat.js admin lora ...`: prints what happened and exits 0, or the server's status and exits 1.
async function adminMain(argv) {
  const args = parseArgs(argv);
  const token = tokenFrom(args.tokenFile, ['TANDEM_ADMIN_TOKEN', 'TANDEM_API_TOKEN']);
  const admin = new AdminClient(args.address, { ...args, token });
  try {
    if (args.step === 'unload') {
      const engines = await admin.unloadLora(args.name);
      process.stdout.write(`unloaded ${args.name} from ${engines.join(', ')}\n`);
      return;
    }
    const result = await { load: () => admin.loadLora(args.name, args.path), list: () => admin.listLoras(),
                           pin: () => admin.pinLora(args.name) }[args.step]();
    if (args.json) {
      process.stdout.write(JSON.stringify(result, null, 2) + '\n');
      return;
    }
    for (const a of result) {
      const fields = [a.name, `rank ${a.rank}`, a.target_modules.join(','), a.location,
                      a.pinned ? 'pinned' : 'unpinned', a.engine, a.path];
      process.stdout.write(fields.join('\t') + '\n');
    }
  } catch (error) {
    if (error.code === undefined) throw error;
    process.stderr.write(`tandem-node: ${statusName(error.code)}: ${error.details}\n`);
    process.exitCode = 1;
  } finally {
    admin.close();
  }
}

module.exports = { AdminClient, adminMain };
