// A typed request built on the TypeScript stubs that `make ts-stubs` generates from protos/
// (protoc-gen-es, see buf.gen.yaml): compiled with tsc, then run with node, which prints the
// request as proto3 JSON after a round trip through the binary wire format.
import { create, fromBinary, toBinary, toJsonString } from "@bufbuild/protobuf";
import { PauseRequestSchema } from "./build/gen/tandem/v1/admin_pb.js";
import { OutputKind, PauseMode } from "./build/gen/tandem/v1/common_pb.js";
import { ChatResponseSchema, GenerateRequestSchema, GenerationService } from "./build/gen/tandem/v1/generation_pb.js";

const request = create(GenerateRequestSchema, {
  requestId: "ts-1",
  prompt: { case: "text", value: "The capital of France is" },
  samplingParams: { temperature: 0, maxTokens: 16, stop: ["."], outputKind: OutputKind.DELTA },
});
const decoded = fromBinary(GenerateRequestSchema, toBinary(GenerateRequestSchema, request));
const pause = create(PauseRequestSchema, { mode: PauseMode.WAIT });

// Each RPC has its own response type: Chat streams ChatResponse, not GenerateResponse.
if (GenerationService.method.chat.output !== ChatResponseSchema) throw new Error("Chat must return ChatResponse");
console.log(toJsonString(GenerateRequestSchema, decoded));
console.log(toJsonString(PauseRequestSchema, pause));
