/**
 * A small reader of flatbuffers (onnxruntime-training's checkpoints, ORT-format models) whose
 * every access is checked against the bytes' length: a truncated or corrupt file raises the
 * reader's error type (CheckpointError unless told otherwise), never a RangeError.
 * @module
 */

import { CheckpointError } from './errors.js';

/** Bounds-checked access to a flatbuffer's bytes. */
export class Reader {
  /**
   * @param {Uint8Array} bytes
   * @param {string} where  what the bytes are, for messages (e.g. "checkpoint 'a.ckpt'")
   * @param {new (message: string) => Error} [ErrorType]  what a corrupt file raises
   */
  constructor(bytes, where, ErrorType = CheckpointError) {
    this.bytes = bytes;
    this.size = bytes.byteLength;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.where = where;
    this.ErrorType = ErrorType;
  }

  /** @param {number} pos @param {number} width */
  check(pos, width) {
    if (!Number.isSafeInteger(pos) || pos < 0 || pos + width > this.size) {
      throw new this.ErrorType(`${this.where} is truncated or corrupt (an offset points outside the file)`);
    }
    return pos;
  }

  /** @param {number} pos */
  uint16(pos) { return this.view.getUint16(this.check(pos, 2), true); }
  /** @param {number} pos */
  int32(pos) { return this.view.getInt32(this.check(pos, 4), true); }
  /** @param {number} pos */
  uint32(pos) { return this.view.getUint32(this.check(pos, 4), true); }

  root() {
    return new Table(this, this.uint32(0));
  }
}

/** One flatbuffer table: its fields are found through its vtable. */
export class Table {
  /** @param {Reader} reader @param {number} pos */
  constructor(reader, pos) {
    this.reader = reader;
    this.pos = pos;
    this.vtable = pos - reader.int32(pos);
    this.vtableSize = reader.uint16(this.vtable);
  }

  /** The position of field `slot`, or null when absent. @param {number} slot */
  field(slot) {
    const entry = 4 + 2 * slot;
    if (entry + 2 > this.vtableSize) return null;
    const offset = this.reader.uint16(this.vtable + entry);
    return offset ? this.pos + offset : null;
  }

  /** Where the offset in field `slot` points, or null when absent. @param {number} slot */
  target(slot) {
    const pos = this.field(slot);
    return pos === null ? null : pos + this.reader.uint32(pos);
  }

  /** @param {number} slot */
  bool(slot) {
    const pos = this.field(slot);
    return pos !== null && this.reader.view.getUint8(this.reader.check(pos, 1)) !== 0;
  }

  /** @param {number} slot */
  int32(slot) {
    const pos = this.field(slot);
    return pos === null ? 0 : this.reader.int32(pos);
  }

  /** @param {number} slot @param {bigint} fallback */
  int64(slot, fallback) {
    const pos = this.field(slot);
    return pos === null ? fallback : this.reader.view.getBigInt64(this.reader.check(pos, 8), true);
  }

  /** @param {number} slot */
  float32(slot) {
    const pos = this.field(slot);
    return pos === null ? 0 : this.reader.view.getFloat32(this.reader.check(pos, 4), true);
  }

  /** @param {number} slot @returns {Table | null} */
  table(slot) {
    const pos = this.target(slot);
    return pos === null ? null : new Table(this.reader, pos);
  }

  /** @param {number} slot @returns {string | null} */
  string(slot) {
    const found = this.vectorAt(this.target(slot), 1);
    if (found === null) return null;
    const [start, length] = found;
    try {
      return new TextDecoder('utf-8', { fatal: true }).decode(this.reader.bytes.subarray(start, start + length));
    } catch (error) {
      throw new this.reader.ErrorType(`${this.reader.where} holds a name that is not UTF-8: ${/** @type {Error} */ (error).message}`);
    }
  }

  /**
   * `[start, length]` of a vector field; `[0, 0]` when absent.
   * @param {number} slot @param {number} itemSize
   * @returns {[number, number]}
   */
  vector(slot, itemSize) {
    return this.vectorAt(this.target(slot), itemSize) ?? [0, 0];
  }

  /**
   * @param {number | null} pos @param {number} itemSize
   * @returns {[number, number] | null}
   */
  vectorAt(pos, itemSize) {
    if (pos === null) return null;
    const length = this.reader.uint32(pos);
    const start = pos + 4;
    if (start + length * itemSize > this.reader.size) {
      throw new this.reader.ErrorType(`${this.reader.where} is truncated or corrupt (a vector runs past the file's end)`);
    }
    return [start, length];
  }

  /** @param {number} slot @returns {bigint[]} */
  int64s(slot) {
    const [start, length] = this.vector(slot, 8);
    return Array.from({ length }, (_, i) => this.reader.view.getBigInt64(this.reader.check(start + 8 * i, 8), true));
  }

  /** @param {number} slot @returns {Table[]} */
  tables(slot) {
    const [start, length] = this.vector(slot, 4);
    return Array.from({ length }, (_, i) => new Table(this.reader, start + 4 * i + this.reader.uint32(start + 4 * i)));
  }
}
