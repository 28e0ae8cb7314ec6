// What chat.js and admin.js share: the protos (loaded at run time), one-line errors, the files
// flags name, the channel's credentials (TLS) and the bearer token.
'use strict';

const path = require('path');
const fs = require('fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');

function fail(message) {
  process.stderr.write(`tandem-node: ${message}\n`);
  process.exit(2);
}

// A file a flag names, or a one-line error (not a stack trace) and exit 2.
function readText(file, flag) {
  try {
    return fs.readFileSync(file, 'utf8');
  } catch (error) {
    const reason = error.message.replace(/^[A-Z]+: /, '').replace(/, \w+ '.*'$/, '');  // "no such file or directory"
    return fail(`${flag}: cannot read ${file} (${reason})`);
  }
}

// A tandem.v1 service's client class from its .proto file. `defaults`: unset fields read as their
// zero values (false: they are absent).
function loadService(file, name, { defaults = false } = {}) {
  const definition = protoLoader.loadSync(`tandem/v1/${file}`, {
    includeDirs: [PROTOS], keepCase: true, longs: String, enums: String, defaults, oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).tandem.v1[name];
}

// As the Python CLI: any TLS option turns TLS on; without tlsCa (PEM text) the system's CAs verify the server.
function connect(Service, address, { tlsCa, tlsServerName } = {}) {
  const tls = tlsCa !== undefined || tlsServerName !== undefined;
  const credentials = tls
    ? grpc.credentials.createSsl(tlsCa === undefined ? null : Buffer.from(tlsCa))
    : grpc.credentials.createInsecure();
  const options = tlsServerName ? { 'grpc.ssl_target_name_override': tlsServerName } : {};
  return new Service(address, credentials, options);
}

// 'authorization: Bearer <token>' when there is a token.
function bearer(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

// The first line of a --token-file, or the first of these environment variables that is set.
function tokenFrom(tokenFile, envs) {
  if (tokenFile !== undefined) return tokenFile.split('\n')[0].trim();
  for (const name of envs) {
    const token = (process.env[name] || '').trim();
    if (token) return token;
  }
  return '';
}

// A gRPC status code's name (NOT_FOUND, ...), as the Python CLI prints it.
function statusName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) || String(code);
}

module.exports = { PROTOS, fail, readText, loadService, connect, bearer, tokenFrom, statusName };
