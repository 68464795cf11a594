{{/* Names ------------------------------------------------------------------------------ */}}
{{- define "delay-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* 50 characters at most: the objects' names append a suffix such as -distributor */}}
{{- define "delay-gateway.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "delay-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "delay-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "delay-gateway.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The broker Secret: the chart's own when broker.url is given inline, else broker.existingSecret */}}
{{- define "delay-gateway.brokerSecret" -}}
{{- if .Values.broker.url -}}
{{- include "delay-gateway.fullname" . }}-broker
{{- else -}}
{{- .Values.broker.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "delay-gateway.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels: the standard app.kubernetes.io set; call with (dict "root" $ "component" "check-in") */}}
{{- define "delay-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "delay-gateway.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "delay-gateway.labels" -}}
helm.sh/chart: {{ include "delay-gateway.chart" .root }}
{{ include "delay-gateway.selectorLabels" . }}
app.kubernetes.io/part-of: delay-gateway
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* The gateway's settings, DELAY_GATEWAY_* of gateway/settings.py's OPTIONS (each option
     that has a Helm value name); the ConfigMap holds them, the topology Job sets them
     directly (it runs before an upgrade changes the ConfigMap). */}}
{{- define "delay-gateway.settings" -}}
DELAY_GATEWAY_VHOSTS: {{ join "," .Values.vhosts | quote }}
DELAY_GATEWAY_GATEWAY_USER: {{ .Values.gatewayUser | quote }}
DELAY_GATEWAY_MANAGEMENT_URL: {{ .Values.managementUrl | quote }}
DELAY_GATEWAY_PREFIX: {{ .Values.prefix | quote }}
DELAY_GATEWAY_MAX_LEVEL: {{ int64 .Values.maxLevel | quote }}
DELAY_GATEWAY_RESOLUTION_MS: {{ int64 .Values.resolutionMs | quote }}
DELAY_GATEWAY_QUEUE_TYPE: {{ .Values.queueType | quote }}
DELAY_GATEWAY_ZERO_BITS: {{ .Values.zeroBits | quote }}
DELAY_GATEWAY_PREFETCH: {{ int64 .Values.prefetch | quote }}
DELAY_GATEWAY_DISTRIBUTOR_PREFETCH: {{ int64 .Values.distributorPrefetch | quote }}
DELAY_GATEWAY_HOLD_WITHIN_MS: {{ int64 .Values.holdWithinMs | quote }}
DELAY_GATEWAY_HOLD_MESSAGES: {{ int64 .Values.holdMessages | quote }}
DELAY_GATEWAY_CATCH_UP_RATE: {{ .Values.catchUpRate | toString | quote }}
DELAY_GATEWAY_DUE_GAUGES_EVERY: {{ .Values.dueGaugesEvery | toString | quote }}
DELAY_GATEWAY_LEAD_MS: {{ int64 .Values.leadMs | quote }}
DELAY_GATEWAY_CARRIER_MESSAGES: {{ int64 .Values.carrierMessages | quote }}
DELAY_GATEWAY_CARRIER_WAIT_MS: {{ int64 .Values.carrierWaitMs | quote }}
DELAY_GATEWAY_CARRIER_BYTES: {{ int64 .Values.carrierBytes | quote }}
DELAY_GATEWAY_STAMP_DUE_AT: {{ .Values.stampDueAt | toString | quote }}
DELAY_GATEWAY_METRICS_PORT: {{ int64 .Values.metricsPort | quote }}
DELAY_GATEWAY_LOG_LEVEL: {{ .Values.logLevel | quote }}
DELAY_GATEWAY_LOG_FORMAT: {{ .Values.logFormat | quote }}
DELAY_GATEWAY_CONFIRM_TIMEOUT: {{ .Values.confirmTimeoutSeconds | toString | quote }}
DELAY_GATEWAY_RETIRE: {{ .Values.retire | toString | quote }}
DELAY_GATEWAY_RETIRE_AFTER: {{ .Values.retireAfterSeconds | toString | quote }}
DELAY_GATEWAY_PENDING_INDEX: {{ .Values.pendingIndex | toString | quote }}
DELAY_GATEWAY_RETRY_BASE_MS: {{ int64 .Values.retryBaseMs | quote }}
DELAY_GATEWAY_RETRY_FACTOR: {{ .Values.retryFactor | toString | quote }}
DELAY_GATEWAY_RETRY_CAP_MS: {{ int64 .Values.retryCapMs | quote }}
DELAY_GATEWAY_RETRY_ATTEMPTS: {{ int64 .Values.retryAttempts | quote }}
DELAY_GATEWAY_RETRY_JITTER: {{ .Values.retryJitter | toString | quote }}
DELAY_GATEWAY_RETRY_QUEUES: {{ .Values.retryQueues | quote }}
DELAY_GATEWAY_RETRY_POLICIES: {{ if .Values.retryPolicies }}{{ .Values.retryPolicies | toJson | quote }}{{ else }}""{{ end }}
{{- end -}}

{{/* Where the broker's secrets appear inside the container, then the user's extraEnv */}}
{{- define "delay-gateway.env" -}}
- name: DELAY_GATEWAY_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "delay-gateway.brokerSecret" . }}
      key: {{ .Values.broker.urlKey }}
- name: DELAY_GATEWAY_PASSWORD_FILE
  value: /etc/delay-gateway/broker/password
{{- if .Values.tls.caSecret }}
- name: DELAY_GATEWAY_TLS_CA_FILE
  value: /etc/delay-gateway/tls-ca/ca.crt
{{- end }}
{{- if .Values.tls.clientSecret }}
- name: DELAY_GATEWAY_TLS_CERT_FILE
  value: /etc/delay-gateway/tls-client/tls.crt
- name: DELAY_GATEWAY_TLS_KEY_FILE
  value: /etc/delay-gateway/tls-client/tls.key
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "delay-gateway.volumeMounts" -}}
- name: broker
  mountPath: /etc/delay-gateway/broker
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.caSecret }}
- name: tls-ca
  mountPath: /etc/delay-gateway/tls-ca
  readOnly: true
{{- end }}
{{- if .Values.tls.clientSecret }}
- name: tls-client
  mountPath: /etc/delay-gateway/tls-client
  readOnly: true
{{- end }}
{{- end -}}

{{- define "delay-gateway.volumes" -}}
- name: broker
  secret:
    secretName: {{ include "delay-gateway.brokerSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.broker.passwordKey }}
        path: password
- name: tmp
  emptyDir:
    sizeLimit: 16Mi
{{- if .Values.tls.caSecret }}
- name: tls-ca
  secret:
    secretName: {{ .Values.tls.caSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.tls.caKey }}
        path: ca.crt
{{- end }}
{{- if .Values.tls.clientSecret }}
- name: tls-client
  secret:
    secretName: {{ .Values.tls.clientSecret }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end -}}

{{/* The pod template's metadata; call with (dict "root" $ "component" "check-in" "annotations" (dict ...)):
     the chart's labels (they win over podLabels), podAnnotations after the chart's own */}}
{{- define "delay-gateway.podMetadata" -}}
{{- $labels := include "delay-gateway.labels" (dict "root" .root "component" .component) | fromYaml -}}
labels:
  {{- toYaml (merge $labels .root.Values.podLabels) | nindent 2 }}
{{- $annotations := merge (dict) (.annotations | default dict) .root.Values.podAnnotations }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The container's security context: securityContext (default: non-root, read-only root
     filesystem, no privilege escalation, no capabilities) */}}
{{- define "delay-gateway.securityContext" -}}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The pod spec parts every gateway pod shares; call with the root context */}}
{{- define "delay-gateway.podCommon" -}}
serviceAccountName: {{ include "delay-gateway.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* One role's Deployment; call with (dict "root" $ "role" "check-in" "values" .Values.checkIn) */}}
{{- define "delay-gateway.deployment" -}}
{{- $root := .root -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "delay-gateway.fullname" $root }}-{{ .role }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "delay-gateway.labels" (dict "root" $root "component" .role) | nindent 4 }}
spec:
  replicas: {{ int64 .values.replicas }}
  revisionHistoryLimit: 5
  # a new pod must be consuming (ready) before an old one stops: no gap in consumers
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "delay-gateway.selectorLabels" (dict "root" $root "component" .role) | nindent 6 }}
  template:
    metadata:
      {{- $checksum := dict "checksum/settings" (include "delay-gateway.settings" $root | sha256sum) }}
      {{- include "delay-gateway.podMetadata" (dict "root" $root "component" .role "annotations" $checksum) | nindent 6 }}
    spec:
      {{- include "delay-gateway.podCommon" $root | nindent 6 }}
      {{- with $root.Values.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- range . }}
        {{- $constraint := deepCopy . }}
        {{- if not (hasKey $constraint "labelSelector") }}
        {{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "delay-gateway.selectorLabels" (dict "root" $root "component" $.role) | fromYaml)) }}
        {{- end }}
        - {{ toYaml $constraint | indent 10 | trim }}
        {{- end }}
      {{- end }}
      # SIGTERM: stop consuming, hand back held messages, wait up to 10 s for confirms
      terminationGracePeriodSeconds: 30
      containers:
        - name: gateway
          image: {{ include "delay-gateway.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: [run, --role, {{ .role }}]
          envFrom:
            - configMapRef:
                name: {{ include "delay-gateway.fullname" $root }}-settings
          env:
            {{- include "delay-gateway.env" $root | nindent 12 }}
          ports:
            - name: metrics
              containerPort: {{ int64 $root.Values.metricsPort }}
              protocol: TCP
          # alive: the worker's loop reports (a hung process is restarted; one waiting for
          # the broker with backoff is not)
          livenessProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 3
          # ready: connected and consuming every queue of the role
          readinessProbe:
            httpGet: {path: /readyz, port: metrics}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 2
          resources:
            {{- toYaml .values.resources | nindent 12 }}
          {{- include "delay-gateway.securityContext" $root | nindent 10 }}
          volumeMounts:
            {{- include "delay-gateway.volumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "delay-gateway.volumes" $root | nindent 8 }}
{{- end -}}

{{/* One role's PodDisruptionBudget */}}
{{- define "delay-gateway.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "delay-gateway.fullname" .root }}-{{ .role }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "delay-gateway.labels" (dict "root" .root "component" .role) | nindent 4 }}
spec:
  maxUnavailable: {{ .root.Values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "delay-gateway.selectorLabels" (dict "root" .root "component" .role) | nindent 6 }}
{{- end -}}
